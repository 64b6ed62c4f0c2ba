"""Hypothesis strategies for hostile values from outside, and a TOML writer that keeps them.

inf, nan, huge, tiny and negative numbers, control characters, long strings,
wrong types and nesting: what a careless operator or an attacker writes into a
manifest, a routes file, a config file or an admin body.
"""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import strategies as st

EDGE_VALUES: list[Any] = [
    float("inf"), float("-inf"), float("nan"), 1e300, -1e300, 1e-300, 1e-5, -0.0, 0.0, 0.5,
    0, 1, -1, 2**31, 2**53 + 1, 2**63 - 1, -(2**63), True, False,
    "", " ", "\n", "\x00", "\x1b[2J", "iris\n", "a" * 300, "a" * 5000, "../../etc", "/abs", "models:../x",
    "add", "add@1.0.0", "add@1.0.0\n", "add@9.9.9", "x-user-id", "\ud800",
]  # fmt: skip

scalars = st.one_of(
    st.sampled_from(EDGE_VALUES),
    st.floats(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.text(max_size=12),
    st.booleans(),
)

values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
"""Any TOML-expressible value, scalars or small nested tables and arrays."""

rate_limits = st.one_of(
    st.fixed_dictionaries({"rps": scalars}, optional={"burst": scalars}),
    values,
)

names = st.one_of(
    st.sampled_from(["add", "canary", "x", "Add", "add\n", "a" * 65]), st.text(max_size=10)
)


def nested(depth: int) -> str:
    """An array nested ``depth`` deep, as TOML or JSON text."""
    return "[" * depth + "]" * depth


def toml_value(value: Any) -> str:
    """``value`` as an inline TOML value (an invalid string escape makes invalid TOML: fine)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }"
    return '""'


def toml_document(tables: dict[str, Any]) -> bytes:
    """Top-level keys, each ``key = <inline value>``, as the bytes of a file (a lone
    surrogate is written as it comes: bytes that are not UTF-8)."""
    text = "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in tables.items())
    return text.encode("utf-8", "surrogatepass")
