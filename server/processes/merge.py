"""What the workers answer, merged into the answer of one server.

Counts add up (requests, executions, in-flight, histogram buckets); what every
worker holds alike (a version's manifest, the route table) is taken once; where
workers disagree on a version's state, the answer says so per worker.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

SUMMED_PLUGIN_FIELDS = (
    "in_flight",
    "queued",
    "executions",
    "batched_rows",
    "inline_executions",
    "circuit_trips",
)
PROCESS_FIELDS = frozenset({"queued", "executions", "batched_rows", "restarts"})
"""An isolated runner's figures: its processes' own, which every worker reads alike (the
latest read, the largest, is kept; never added)."""
IDENTITY_FIELDS = frozenset({"batch_size"})
"""Numbers that name what a count is of: kept, never added."""
STATE_ORDER = ("failed", "loading", "draining", "ready", "available", "unloaded")
"""When workers disagree on a version's state, the first of these that any of them has."""


def plugins(answers: Sequence[tuple[int, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """``/admin/plugins`` lists from each worker (by pid): each version once, counts summed.

    A version's state is the one every worker has; where they differ, the first
    of :data:`STATE_ORDER` that any has, with ``states`` by pid. ``waiting_for``
    (a runner version not yet eligible for a route) lists what it waits for in
    any worker.
    """
    merged: dict[tuple[str, str, str], dict[str, Any]] = {}
    states: dict[tuple[str, str, str], dict[str, str]] = {}
    order: list[tuple[str, str, str]] = []
    for pid, rows in answers:
        for row in rows:
            key = (row["type"], row["name"], row["version"])
            states.setdefault(key, {})[str(pid)] = row["state"]
            kept = merged.get(key)
            if kept is None:
                merged[key] = dict(row)
                order.append(key)
                continue
            isolated = row.get("isolation") == "process"
            for name in SUMMED_PLUGIN_FIELDS:
                if isinstance(row.get(name), int):
                    if isolated and name in PROCESS_FIELDS:
                        kept[name] = max(kept.get(name, 0), row[name])
                    else:
                        kept[name] = kept.get(name, 0) + row[name]
            if isolated:
                kept["restarts"] = max(kept.get("restarts", 0), row.get("restarts", 0))
                kept["pids"] = sorted({*kept.get("pids", []), *row.get("pids", [])})
            if kept.get("last_error") is None and row.get("last_error") is not None:
                kept["last_error"] = row["last_error"]
            if row.get("waiting_for"):  # what it waits for in any worker
                waits = kept.setdefault("waiting_for", [])
                waits += [w for w in row["waiting_for"] if w not in waits]
    out = []
    for key in order:
        row, by_pid = merged[key], states[key]
        distinct = set(by_pid.values())
        if len(distinct) > 1 or len(by_pid) < len(answers):
            row["state"] = next(s for s in STATE_ORDER if s in distinct)
            row["states"] = by_pid
        out.append(row)
    return out


def counts(first: Any, second: Any) -> Any:
    """Two answers of the same shape added up: numbers summed, the rest from ``first``.

    Lists of objects with a ``batch_size`` (Triton's ``batch_stats``) add up by
    batch size; ``last_inference`` (a time) takes the later one.
    """
    if isinstance(first, dict) and isinstance(second, dict):
        out = dict(first)
        for key, value in second.items():
            if key not in out:
                out[key] = value
            elif key == "last_inference":
                out[key] = max(out[key] or 0, value or 0)
            elif key in IDENTITY_FIELDS:
                continue
            else:
                out[key] = counts(out[key], value)
        return out
    if isinstance(first, list) and isinstance(second, list):
        if all(isinstance(x, dict) and "batch_size" in x for x in [*first, *second]):
            by_size = {x["batch_size"]: x for x in first}
            for item in second:
                size = item["batch_size"]
                by_size[size] = counts(by_size[size], item) if size in by_size else item
            return [by_size[s] for s in sorted(by_size)]
        return first
    if _is_number(first) and _is_number(second):
        return first + second
    return first


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def model_stats(answers: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Triton statistics from each worker, added up per route and version."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for answer in answers:
        for entry in answer.get("model_stats", []):
            key = (entry["name"], entry["version"])
            merged[key] = counts(merged[key], entry) if key in merged else entry
    return {"model_stats": [merged[k] for k in sorted(merged)]}


def sync_reports(answers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``POST /admin/reload`` answers: each version listed once, a failure on any worker kept."""
    if not answers:
        return {}
    out: dict[str, Any] = dict(answers[0])
    failed: dict[str, dict[str, str]] = {}
    for answer in answers:
        for item in answer.get("failed", []):
            failed.setdefault(item.get("plugin") or item.get("plugins_dir", ""), item)
    for name in ("loaded", "reloaded", "unloaded", "available"):
        out[name] = sorted({label for a in answers for label in a.get(name, [])} - set(failed))
    out["failed"] = list(failed.values())
    out["unchanged"] = min(a.get("unchanged", 0) for a in answers)
    return out


# -- Prometheus text ---------------------------------------------------------------------

PER_SERVER_GAUGES = frozenset(
    {
        "plugserve_plugin_versions",
        "plugserve_circuit_open",
        "plugserve_fleet_connected",
        "plugserve_fleet_revision",
        "plugserve_fleet_replicas",
        "plugserve_fleet_invalid_entries",
    }
)
"""Gauges that describe the server's state, alike in every worker: taken as the highest,
not summed (a version ready in every worker is one version)."""


PER_SERVER_EVENTS = frozenset(
    {"plugserve_plugin_lifecycle_total", "plugserve_plugin_lifecycle_duration_seconds"}
)
"""Counts of what happens to the server once and to every worker alike (a version loads
in each): the highest count, which a replaced worker's fresh one does not lower."""


def counts_only(text: str) -> str:
    """A worker's last ``/metrics`` without what stops with it (gauges, ``_created``, the
    per-server counts): what it counted, to keep in the server's totals once it has ended."""
    kept: list[str] = []
    keep = False
    help_line = ""
    for line in text.splitlines():
        parts = line.split(" ", 3) if line.startswith("#") else []
        if len(parts) >= 4 and parts[1] == "HELP":
            help_line = line
        elif len(parts) >= 4 and parts[1] == "TYPE":
            family = parts[2]
            keep = (
                parts[3] in ("counter", "histogram", "summary")
                and family not in PER_SERVER_EVENTS
                and not family.endswith("_created")
            )
            if keep:
                kept += [help_line, line]
        elif keep and line and not line.startswith("#"):
            kept.append(line)
    return "\n".join(kept) + "\n"


def metrics(texts: Sequence[tuple[str, str]], retired: Sequence[str] = ()) -> str:
    """Prometheus text from each worker (by worker index), as one server's.

    Counters, histograms and summed gauges add up over workers; the gauges of
    :data:`PER_SERVER_GAUGES` take the highest; ``_created`` series the earliest.
    ``plugserve_in_flight`` is also given per worker (``plugserve_worker_in_flight``).
    ``retired``: the counts of workers that ended (:func:`counts_only`), so that the
    server's counters never go down when a worker is replaced. Read line by line,
    never parsed into objects: a sample's series (name and labels, as written) is
    its key, its value the last field (tests/benchmarks/scrape.py: a full parse cost
    ~130 ms a worker for 20 versions).
    """
    headers: dict[str, list[str]] = {}
    kinds: dict[str, str] = {}
    values: dict[str, dict[str, float]] = {}
    per_worker: dict[str, float] = {}
    for worker, text in [*texts, *(("", r) for r in retired)]:
        family = ""
        for line in text.splitlines():
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) >= 4 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    known = headers.setdefault(family, [])
                    if len(known) < 2 and line not in known:
                        known.append(line)
                    if parts[1] == "TYPE":
                        kinds[family] = parts[3]
                continue
            if not line:
                continue
            series, _, raw = line.rpartition(" ")
            value = float(raw)
            samples = values.setdefault(family, {})
            name = series.partition("{")[0]
            if name == "plugserve_in_flight":
                per_worker[worker] = per_worker.get(worker, 0.0) + value
            kept = samples.get(series)
            if kept is None:
                samples[series] = value
            elif name.endswith("_created"):
                samples[series] = min(kept, value)
            elif family in PER_SERVER_GAUGES or family in PER_SERVER_EVENTS:
                samples[series] = max(kept, value)
            else:
                samples[series] = kept + value
    lines: list[str] = []
    for family, header in headers.items():
        lines.extend(header)
        lines.extend(f"{series} {_number(v)}" for series, v in values.get(family, {}).items())
    if texts:
        lines.append(
            "# HELP plugserve_worker_in_flight Requests using a plugin version now, by worker."
        )
        lines.append("# TYPE plugserve_worker_in_flight gauge")
        for worker, _ in texts:
            value = per_worker.get(worker, 0.0)
            lines.append(f'plugserve_worker_in_flight{{worker="{worker}"}} {_number(value)}')
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if math.isfinite(value) and value == int(value) and abs(value) < 2**53:
        return f"{int(value)}.0"
    return repr(value)
