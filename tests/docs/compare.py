"""Compare what a doc shows with what the server printed.

Placeholders a doc may use in an example output:

- JSON: ``...`` (or ``"..."``) stands for any value; ``{...}`` and ``[...]`` for any
  object or list; ``, ...}`` ends an object that has more keys; ``, ...]`` a list
  with more elements. Numbers match to a relative 1e-5 (absolute 1e-7), so another
  ONNX Runtime build's last digits still match; but a float must be printed as the
  server prints it: as many significant digits (within 2) and the same exponent
  form (``7.4847844e-7``, not ``7.484784418920754e-07``).
- Text: ``...`` stands for any text (on one line or across lines); otherwise exact,
  trailing blanks ignored.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

ANY = "..."
MORE = "...more..."


class Printed(float):
    """A JSON float that remembers how it was written."""

    text: str

    def __new__(cls, text: str) -> Printed:
        number = super().__new__(cls, text)
        number.text = text
        return number


def digits(text: str) -> int:
    mantissa = re.split(r"[eE]", text)[0].replace("-", "").replace(".", "")
    return len(mantissa.lstrip("0"))


def printed_alike(expected: Printed, actual: Printed) -> bool:
    """The same form: significant digits within 2, the exponent written the same way."""
    form = re.compile(r"[eE][+-]?0\d")
    return abs(digits(expected.text) - digits(actual.text)) <= 2 and bool(
        form.search(expected.text)
    ) == bool(form.search(actual.text))


def parse_expected(text: str) -> Any:
    """The doc's JSON with its placeholders made values; raises ValueError if not JSON."""
    text = re.sub(r"\{\s*\.\.\.\s*\}|\[\s*\.\.\.\s*\]", '"..."', text)
    text = re.sub(r",\s*\.\.\.\s*\}", f', "{MORE}": true}}', text)
    text = re.sub(r",\s*\.\.\.\s*\]", f', "{MORE}"]', text)
    text = re.sub(r"(?<=:)\s*\.\.\.\s*(?=[,}])", ' "..."', text)
    return json.loads(text, parse_float=Printed)


def json_mismatch(expected: Any, actual: Any, where: str = "$") -> str | None:
    """Where ``actual`` differs from ``expected`` (with its placeholders), or ``None``."""
    if expected == ANY:
        return None
    if isinstance(expected, bool) or isinstance(actual, bool):
        return None if expected is actual else f"{where}: {actual!r} is not {expected!r}"
    if isinstance(expected, int | float) and isinstance(actual, int | float):
        if not math.isclose(expected, actual, rel_tol=1e-5, abs_tol=1e-7):
            return f"{where}: {actual!r} is not {expected!r}"
        printed = isinstance(expected, Printed) and isinstance(actual, Printed)
        if printed and not printed_alike(expected, actual):
            return f"{where}: printed {actual.text}, the doc shows {expected.text}"
        return None
    if isinstance(expected, dict) and isinstance(actual, dict):
        more = expected.pop(MORE, False)
        missing = expected.keys() - actual.keys()
        extra = set() if more else actual.keys() - expected.keys()
        if missing or extra:
            return f"{where}: keys missing {sorted(missing)}, not in the doc {sorted(extra)}"
        for key, value in expected.items():
            if problem := json_mismatch(value, actual[key], f"{where}.{key}"):
                return problem
        return None
    if isinstance(expected, list) and isinstance(actual, list):
        more = bool(expected) and expected[-1] == MORE
        shown = expected[:-1] if more else expected
        if len(actual) < len(shown) or (not more and len(actual) != len(shown)):
            return f"{where}: {len(actual)} elements, the doc shows {len(shown)}"
        for index, value in enumerate(shown):
            if problem := json_mismatch(value, actual[index], f"{where}[{index}]"):
                return problem
        return None
    return None if expected == actual else f"{where}: {actual!r} is not {expected!r}"


def text_matches(expected: str, actual: str) -> bool:
    """Exact, but ``...`` matches any text and trailing blanks do not count."""
    expected = "\n".join(line.rstrip() for line in expected.strip().splitlines())
    actual = "\n".join(line.rstrip() for line in actual.strip().splitlines())
    pattern = ".*?".join(re.escape(part) for part in expected.split(ANY))
    return re.fullmatch(pattern, actual, re.S) is not None


def mismatch(expected: str, actual: str) -> str | None:
    """Compare an example output: as JSON when the doc shows JSON, else as text."""
    try:
        wanted = parse_expected(expected)
    except ValueError:
        return None if text_matches(expected, actual) else "the text differs"
    try:
        got = json.loads(actual, parse_float=Printed)
    except ValueError:
        return "the doc shows JSON; the command printed something else"
    return json_mismatch(wanted, got)
