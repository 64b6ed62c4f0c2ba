"""A commit message's subject is one line of at most 100 characters, then a blank line
before any body (pre-commit's ``commit-msg`` stage runs this on the message file)."""

from __future__ import annotations

import sys
from pathlib import Path

MAX_SUBJECT = 100


def problem(message: str) -> str | None:
    """What is wrong with ``message``'s subject, or ``None``."""
    lines = [line for line in message.splitlines() if not line.startswith("#")]
    if not lines or not lines[0].strip():
        return "the subject is empty"
    if len(lines[0]) > MAX_SUBJECT:
        length = len(lines[0])
        return f"the subject is {length} characters; at most {MAX_SUBJECT}: the rest in the body"
    if len(lines) > 1 and lines[1].strip():
        return "a blank line goes between the subject and the body"
    return None


if __name__ == "__main__":
    found = problem(Path(sys.argv[1]).read_text(encoding="utf-8"))
    if found:
        print(f"commit message: {found}", file=sys.stderr)
        raise SystemExit(1)
