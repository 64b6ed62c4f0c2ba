"""The data plane: one request path under every front end (``plane.py``), what it reads of
a call and the ``ctx`` it makes (``context.py``), and how a request's failure is counted
and logged (``outcomes.py``)."""
