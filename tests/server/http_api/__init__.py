"""http api."""
