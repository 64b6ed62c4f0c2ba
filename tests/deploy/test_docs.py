"""docs/deploy.md quotes deploy/: the quotes stay what the files say."""

from __future__ import annotations

import re

import yaml

from plugserve.server.config import Settings
from plugserve.server.runtime.shutdown import SHUTDOWN_MARGIN_S
from tests.deploy.files import KUBERNETES, SYSTEMD, find
from tests.helpers import ROOT

DOC = (ROOT / "docs" / "deploy.md").read_text()


def test_adapter_rule_is_the_values_files() -> None:
    (block,) = (b for b in re.findall(r"```yaml\n(.*?)```", DOC, re.DOTALL) if "rules:" in b)
    values = yaml.safe_load((KUBERNETES / "prometheus-adapter-values.yaml").read_text())
    assert yaml.safe_load(block)["rules"]["custom"] == values["rules"]["custom"]


def test_numbers_quoted_are_the_manifests() -> None:
    pod = find("Deployment", "plugserve")["spec"]["template"]["spec"]
    assert f"terminationGracePeriodSeconds: {pod['terminationGracePeriodSeconds']}" in DOC
    sleep = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert f"(`{' '.join(sleep)}`)" in DOC
    stop = re.search(r"TimeoutStopSec=(\d+)", (SYSTEMD / "plugserve.service").read_text())
    assert stop and f"`TimeoutStopSec={stop.group(1)}`" in DOC
    # Every stop timeout the page gives Docker covers the drain and its bound.
    for seconds in re.findall(r"(?:--stop-timeout|--time) (\d+)", DOC):
        assert int(seconds) > Settings().drain_timeout_s + SHUTDOWN_MARGIN_S
