"""The harness's own conventions: markers, sessions and placeholders."""

from __future__ import annotations

from pathlib import Path

from tests.docs.blocks import blocks, printed, session
from tests.docs.compare import mismatch


def test_json_numbers_match_to_a_tolerance_but_in_the_servers_form() -> None:
    served = '{"p": [0.98028725, 7.4847844e-7]}'
    assert mismatch('{"p": [0.98028726, 7.4847845e-7]}', served) is None
    assert "0.9802872538566589" in str(
        mismatch('{"p": [0.9802872538566589, 7.4847844e-7]}', served)
    )
    assert "e-07" in str(mismatch('{"p": [0.98028725, 7.4847844e-07]}', served))
    assert "is not" in str(mismatch('{"p": [0.97, 7.4847844e-7]}', served))


def test_json_placeholders() -> None:
    served = '{"route": {"name": "iris"}, "entry": [1, 2, 3], "revision": 1}'
    assert mismatch('{"route": {...}, "entry": [...], "revision": 1}', served) is None
    assert mismatch('{"route": ..., "entry": [1, ...], ...}', served) is None
    assert "not in the doc" in str(mismatch('{"route": {...}, "entry": [...]}', served))
    assert "elements" in str(mismatch('{"route": {...}, "entry": [1, 2], "revision": 1}', served))


def test_text_placeholders() -> None:
    assert mismatch("folder: .../proj (a package)", "folder: /tmp/x/proj (a package)  ") is None
    assert mismatch("folder: .../proj", "folder: /tmp/x/other") == "the text differs"


def test_blocks_markers_sessions_and_printed_comments(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Text.\n\n<!-- docs-test: skip (needs docker) -->\n```sh\ndocker ps\n```\n\n"
        "```sh\n$ echo a \\\n  b\na b\n$ true\n```\n\n"
        "```python\nprint(1)   # 1\nx = 2  # not output\n```\n"
    )
    skip, run, code = blocks(doc)
    assert (skip.marker, skip.reason, skip.line) == ("skip", "needs docker", 4)
    assert run.marker is None
    steps = session(run.text) or []
    assert [(s.command, s.output) for s in steps] == [("echo a \\\n  b", "a b"), ("true", "")]
    assert session(skip.text) is None
    assert printed(code.text) == "1"
