"""Plugin versions over time: the registry (every version's record, load, swap, drain,
release, and the route table rebuilt from them), the loader (one version built and
released) and the watcher (the folders, watched)."""
