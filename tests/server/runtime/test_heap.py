"""server/runtime/heap.py: the collector's settings of a serving process, in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT

SETTLED = """
import gc, json, weakref
from plugserve.server.runtime import heap
before = gc.get_threshold()
heap.settle()
after = gc.get_threshold()
frozen = gc.get_freeze_count()

class Node:
    pass

# Reference cycles made after start-up are still collected, without an explicit collect().
first = Node(); first.me = first
alive = weakref.ref(first)
del first
for _ in range(50_000):
    node = Node(); node.me = node
del node
print(json.dumps({"before": before, "after": after, "frozen": frozen,
                  "first_cycle_alive": alive() is not None}))
"""


def run(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_settle_freezes_start_up_and_raises_the_young_threshold_only() -> None:
    seen = run(SETTLED)
    assert seen["before"][0] == 700  # Python's default, what the change is measured against
    assert seen["after"] == [10_000, *seen["before"][1:]]
    assert seen["frozen"] > 1000  # the imports made so far are out of the collector's sight


def test_cycles_made_while_serving_are_still_collected() -> None:
    assert run(SETTLED)["first_cycle_alive"] is False
