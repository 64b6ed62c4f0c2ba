"""The fenced blocks of README.md and docs/*.md, with the markers that say how to check them.

A marker is an HTML comment on the last non-blank line before a block's fence
(invisible when rendered):

- ``<!-- docs-test: skip (why) -->``: the block is not run; the reason is listed.
- ``<!-- docs-test: file PATH -->``: the block quotes PATH (repository-relative).
- ``<!-- docs-test: example PATH -->``: the block is PATH of the bundled plugins in a
  shortened form: the doc's examples, put in place of those files, must serve the
  README's first answer (tests/docs/test_examples.py::test_the_guides_examples_serve).
- ``<!-- docs-test: check NAME -->``: a named check of the harness (tests/docs/checks.py).

Without a marker, ``sh`` blocks and ``python`` blocks are run and ``toml`` blocks
loaded (tests/docs/test_examples.py); any other block needs a marker.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*docs-test:\s*(skip|file|example|check)\s*(.*?)\s*-->")
FENCE = re.compile(r"^(`{3,})(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text and its marker."""

    doc: str  # repository-relative, "docs/api.md"
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: str | None = None  # "skip", "file", "example", "check"
    argument: str = ""

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line} (```{self.lang or ''} block)"

    @property
    def reason(self) -> str:
        """A skip marker's reason, without its parentheses."""
        return self.argument.strip().removeprefix("(").removesuffix(")")


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, in order."""
    lines = path.read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        end = index + 1
        while not lines[end].startswith(opening.group(1)):
            end += 1
        before = [line for line in lines[:index] if line.strip()]
        marker = MARKER.search(before[-1]) if before else None
        found.append(
            Block(
                doc=(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path).as_posix(),
                line=index + 1,
                lang=opening.group(2),
                text="\n".join(lines[index + 1 : end]) + "\n",
                marker=marker.group(1) if marker else None,
                argument=marker.group(2) if marker else "",
            )
        )
        index = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for doc in DOCS for block in blocks(doc)]


@dataclass(frozen=True)
class Step:
    """One ``$ command`` of a shell session and the output the doc shows for it."""

    command: str
    output: str


def session(text: str) -> list[Step] | None:
    """A ``sh`` block of ``$ command`` lines (``\\`` continues one) and their output;
    ``None`` when the block has no ``$`` line (a block of plain commands)."""
    steps: list[Step] = []
    command: list[str] | None = None
    output: list[str] = []
    for line in text.splitlines():
        if command is not None and command[-1].endswith("\\"):
            command.append(line)
        elif line.startswith("$ "):
            if command is not None:
                steps.append(Step("\n".join(command), "\n".join(output)))
            command, output = [line[2:]], []
        elif command is not None:
            output.append(line)
    if command is None:
        return None
    steps.append(Step("\n".join(command), "\n".join(output)))
    return steps


def printed(source: str) -> str:
    """What a python block says it prints: the ``# comments`` of its ``print(`` lines."""
    said = re.findall(r"^\s*print\(.*?\)\s+#\s?(.*)$", source, re.M)
    return "\n".join(said)


HOW_TO_MARK = (
    "make it runnable (a ```sh block of `$ command` lines, each followed by its output), "
    "or put <!-- docs-test: skip (why it cannot run here) --> on the line before its fence "
    "(see tests/docs/blocks.py for the markers)"
)
