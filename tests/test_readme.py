"""The README's promises: its test command is what CI runs, its examples exist."""

import re

from tests.helpers import ROOT


def readme_commands() -> list[str]:
    block = re.search(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block is not None
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_two_commands_and_ci_runs_the_second_verbatim() -> None:
    serve, test = readme_commands()
    assert serve.endswith("plugserve serve")
    assert test.endswith("pytest")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci


def test_readme_example_files_exist() -> None:
    for path in ["plugins/runner/iris/1.0.0/plugin.toml", "models/iris/1/model.onnx",
                 "models/iris/train.py", "docs/plugins.md", "docs/api.md", "docs/operations.md"]:  # fmt: skip
        assert (ROOT / path).exists(), path
