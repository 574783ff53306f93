"""Tools around the library: the ``gradsync`` command line, demo, benchmarks, local multi-rank launcher.

``import gradsync`` never imports this package.
"""
