"""The garbage collector's settings for a serving process, once it has started.

Two measured costs on the request path (docs/performance.md, "Where the time goes",
"The garbage collector"):

- full collections over the start-up heap (modules, plugins, models): frozen away;
- young collections: Python collects its youngest generation after 700 more
  container objects (dicts, lists, coroutines, futures) were made than freed.
  64 requests in flight hold more than that alive, so at c=64 it collected
  every ~23 requests, ~190 µs each, and promoted what was in flight into the
  older generations, whose collections then came ten times as often: 11 µs of
  every request. Requests make no reference cycles that outlive them (with the
  threshold at 10,000 the benchmark saw one young collection in 35,000
  requests), so a higher threshold costs no memory here; cyclic garbage, a
  plugin's included, is still collected after 10,000 allocations.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000
"""Allocations less frees of container objects between two young collections (Python: 700)."""


def settle() -> None:
    """Freeze what start-up made (it lives as long as the process) and raise the young
    generation's threshold. Call once the process is ready to serve."""
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(YOUNG_THRESHOLD, young), middle, old)
