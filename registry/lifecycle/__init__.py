"""Plugin versions over time: the registry (discovery and each version's load and release),
the swap beside a serving instance (``swapper``), loads on first request and the budget's
evictions (``on_demand``), the route table rebuilt from the records (``route_keeper``),
the loader (one version built and released), the watcher (the folders, watched) and the
memory budget (``budget``, its accounts in ``ledger``)."""
