"""Several processes behaving as one server: a supervisor and its HTTP workers."""
