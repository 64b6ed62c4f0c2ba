"""Built-in runner backends, registered through the ``plugserve_backends`` hook."""
