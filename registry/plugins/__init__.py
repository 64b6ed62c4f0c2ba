"""Plugin code, found and called: the hooks (the typed facade over pluggy), each version's
modules imported under names of their own, the symlink rule, content fingerprints and
``SHA256SUMS``, and calls into plugin code bounded in time."""
