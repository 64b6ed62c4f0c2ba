"""Every fenced block of README.md and docs/*.md, run or loaded against a live server.

How a block is checked (tests/docs/blocks.py has the markers, tests/docs/compare.py
the placeholders):

- ``sh`` with ``$ command`` lines: each command runs in the doc's project folder
  (``localhost:8000`` is the test server); its output must be the lines after it.
- ``sh`` without: the commands run there and must succeed.
- ``python``: runs there (``127.0.0.1:8000`` and ``:8001`` the test server's); the
  ``# comments`` of its ``print(`` lines are what it must print.
- ``toml``: a plugin manifest, a ``routes.toml`` or a config file, loaded by
  plugserve's own readers; anything else must parse.
- any other block, or one that cannot run here: a marker.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from plugserve.registry.manifest import parse_manifest
from plugserve.registry.routing.route_specs import load_routes_file
from plugserve.server.config import Settings, load_settings
from tests.docs.blocks import HOW_TO_MARK, Block, all_blocks, printed, session
from tests.docs.checks import CHECKS
from tests.docs.compare import mismatch
from tests.docs.conftest import Project
from tests.helpers import ROOT, ServerProcess

pytestmark = pytest.mark.slow
BLOCKS = all_blocks()
TIMEOUT_S = 60


def run(command: str, project: Project, block: Block) -> str:
    done = subprocess.run(
        ["bash", "-c", f"set -eo pipefail\n{project.localize(command)}"],
        cwd=project.folder, env=project.env(), capture_output=True, text=True,
        timeout=TIMEOUT_S,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(
            f"{block.where}: `{command}` exited {done.returncode}:\n{done.stdout}{done.stderr}\n"
            f"Fix the doc, or, if it cannot run here, {HOW_TO_MARK}",
            pytrace=False,
        )
    return done.stdout


def check_sh(block: Block, project: Project) -> None:
    steps = session(block.text)
    if steps is None:
        run(block.text, project, block)
        return
    for step in steps:
        printed_now = run(step.command, project, block)
        expected = step.output.replace("/home/me/proj", str(project.folder))
        if problem := mismatch(expected, printed_now):
            pytest.fail(
                f"{block.where}: `{step.command}` printed\n{printed_now}\n"
                f"where the doc shows\n{step.output}\n({problem})",
                pytrace=False,
            )


def check_python(block: Block, project: Project) -> None:
    script = project.folder / f"block_{block.doc.replace('/', '_')}_{block.line}.py"
    script.write_text(project.localize(block.text))
    stdout = run(f"{sys.executable} {script}", project, block)
    said = printed(block.text)
    if said and (problem := mismatch(said, stdout)):
        pytest.fail(
            f"{block.where}: printed\n{stdout}\nwhere its comments say\n{said}\n({problem})",
            pytrace=False,
        )


def check_toml(block: Block, project: Project) -> None:
    raw = tomllib.loads(block.text)
    folder = project.folder / "toml" / str(block.line)
    folder.mkdir(parents=True)
    if "plugin" in raw:
        (folder / "labels.txt").write_text("a\nb\nc\n")  # the labels file a manifest names
        parse_manifest(raw, folder, check_layout=False)
    elif "routes" in raw:
        (folder / "routes.toml").write_text(block.text)
        load_routes_file(folder / "routes.toml")
    elif all(not isinstance(value, dict) for value in raw.values()):
        unknown = raw.keys() - Settings.model_fields.keys()
        assert not unknown, f"{block.where}: not settings: {sorted(unknown)}"
        config = folder / "plugserve.toml"
        text = block.text
        for key in ("admin_token_file", "inference_token_file"):  # files of the reader's
            if key in raw:
                (folder / key).write_text(f"{key}-{block.line}-secret")
                text = text.replace(f'"{raw[key]}"', f'"{folder / key}"')
        config.write_text(text)
        load_settings(config, environ={})


def check_file(block: Block) -> None:
    path = ROOT / block.argument
    assert path.is_file(), f"{block.where}: its marker names {block.argument}, not a file"
    quoted, real = block.text, path.read_text()
    if path.suffix == ".toml":
        assert tomllib.loads(quoted) == tomllib.loads(real), f"{block.where} != {block.argument}"
    else:
        strip = lambda text: [line.rstrip() for line in text.strip().splitlines()]  # noqa: E731
        assert strip(quoted) == strip(real), f"{block.where} is not what {block.argument} holds"


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.doc}:{b.line}" for b in BLOCKS])
def test_block(block: Block, projects: dict[str, Project]) -> None:
    if block.marker == "skip":
        assert block.reason, f"{block.where}: a skip marker says why: docs-test: skip (why)"
        pytest.skip(f"{block.where}: {block.reason}")
    if block.marker == "file":
        check_file(block)
    elif block.marker == "example":
        assert block.argument.startswith("plugins/"), f"{block.where}: example of what?"
        assert (ROOT / block.argument).is_file(), f"{block.where}: no {block.argument}"
    elif block.marker == "check":
        assert block.argument in CHECKS, f"{block.where}: no check named {block.argument!r}"
        CHECKS[block.argument](block, projects[block.doc])
    elif block.lang == "sh":
        check_sh(block, projects[block.doc])
    elif block.lang == "python":
        check_python(block, projects[block.doc])
    elif block.lang == "toml":
        check_toml(block, projects[block.doc])
    else:
        pytest.fail(f"{block.where} has no docs-test marker: {HOW_TO_MARK}", pytrace=False)


def test_the_docs_have_blocks_and_their_markers_are_known() -> None:
    assert len(BLOCKS) > 40
    assert all(Path(ROOT / b.doc).exists() for b in BLOCKS)


def test_the_guides_examples_serve(tmp_path: Path) -> None:
    """The shortened plugins a doc shows (``docs-test: example``), in place of the bundled
    files, serve the README's first example with the README's answer."""
    examples = [b for b in BLOCKS if b.marker == "example"]
    assert examples, "no docs-test: example blocks"
    shutil.copytree(ROOT / "plugins", tmp_path / "plugins")
    for block in examples:
        (tmp_path / block.argument).write_text(block.text)
    readme = next(b for b in BLOCKS if b.doc == "README.md" and session(b.text))
    (step,) = session(readme.text) or []
    server = ServerProcess(
        "--plugins-dir", str(tmp_path / "plugins"), "--models-dir", str(ROOT / "models"),
        log=tmp_path / "server.log",
    ).wait_ready(60)  # fmt: skip
    try:
        body = re.search(r"-d '(.*)'", step.command)
        assert body, readme.where
        status, _, answer = server.request(
            "POST", "/predict/iris", body.group(1).encode(), {"Content-Type": "application/json"}
        )
    finally:
        server.stop()
    where = ", ".join(b.where for b in examples)
    assert status == 200, f"{where}: {answer!r}"
    assert not (problem := mismatch(step.output, answer.decode())), f"{where}: {problem}"
