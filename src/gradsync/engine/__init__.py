"""The engine: one gradient's trip from its hook to the averaged ``.grad``, and nothing else.

It imports no module wrapper, no optimizer code, nothing elastic and no comm-hook catalogue;
features attach through the reducer's verbs and its commit protocol (``protocol.py``).
"""
