"""The tools of elastic training: ``gradsync run`` (``run.py``) and ``gradsync demo --elastic`` (``demo.py``)."""
