"""dataplane."""
