"""What the docs say outside their code blocks: answers in api.md's tables, the metrics
in operations.md's table, the reload statuses, and links that stay in the repository."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from plugserve.registry.manifest import RUNNER_KEYS
from plugserve.server.config import Settings
from tests.docs.blocks import DOCS
from tests.docs.compare import mismatch, parse_expected
from tests.helpers import ROOT, ServerProcess

pytestmark = pytest.mark.slow
API = (ROOT / "docs" / "api.md").read_text()
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("prose") / "server.log"
    server = ServerProcess(log=log).wait_ready(60)
    yield server
    server.stop()


def answer_rows(text: str) -> list[tuple[str, int | None, str]]:
    """Table rows ``| `GET /path` | [status] `json` ...`` whose path is concrete
    (optional ``[...]`` parts left out) and whose answer is JSON (with the placeholders
    of tests/docs/compare.py), not a list of field names: path, status, the JSON."""
    rows = []
    for path, status, shown in re.findall(
        r"^\| `GET (/[^`{]*)` \| (?:(\d{3}) )?`([\[{][^`]*)`", text, re.M
    ):
        try:
            parse_expected(shown)
        except ValueError:
            continue
        rows.append((re.sub(r"\[[^\]]*\]", "", path), int(status) if status else None, shown))
    return rows


def test_api_md_answers_are_the_servers(bundled: ServerProcess) -> None:
    rows = answer_rows(API)
    assert {"/v2", "/v2/health/live", "/v2/health/ready"} <= {path for path, _, _ in rows}
    wrong = []
    for path, status, shown in rows:
        code, _, body = bundled.request("GET", path)
        if status is not None and code != status:
            wrong.append(f"GET {path}: {code}, docs/api.md says {status}")
        elif problem := mismatch(shown, body.decode()):
            wrong.append(f"GET {path}: {body.decode()} against docs/api.md's {shown} ({problem})")
    assert not wrong, "\n".join(wrong)


def test_api_md_reload_statuses_are_the_servers(bundled: ServerProcess) -> None:
    row = re.search(
        r"^\| `POST /admin/plugins/\{type\}/\{name\}/\{version\}/reload` \|.*$", API, re.M
    )
    assert row and "404 unknown plugin type or folder; 400 invalid name or version" in row.group()
    cases = {
        "/admin/plugins/bogus/iris/1.0.0/reload": 404,  # an unknown type
        "/admin/plugins/runner/nowhere/1.0.0/reload": 404,  # no such folder
        "/admin/plugins/runner/Bad!/1.0.0/reload": 400,
        "/admin/plugins/runner/iris/1.x/reload": 400,
        "/admin/plugins/runner/iris/1.0.0/reload": 200,
    }
    answers = {path: bundled.request("POST", path)[0] for path in cases}
    assert answers == cases


def test_every_metric_operations_md_names_is_served(bundled: ServerProcess) -> None:
    named = set(re.findall(r"^\| `(plugserve_\w+)` \|", OPERATIONS, re.M))
    assert len(named) > 20
    bundled.request(
        "POST", "/predict/iris", b"[[5.1, 3.5, 1.4, 0.2]]", {"Content-Type": "application/json"}
    )
    text = bundled.request("GET", "/metrics")[2].decode()
    served = set(re.findall(r"^# TYPE (\w+) ", text, re.M))
    assert not named - served, (
        f"docs/operations.md names metrics /metrics lacks: {sorted(named - served)}"
    )


def links(doc: Path) -> list[str]:
    return re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text())


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_docs_point_only_at_files_in_the_repository(doc: Path) -> None:
    text = doc.read_text()
    outside = re.findall(r"`(\.\./\S*)`|(CONTRACT\.md)", text)
    assert not outside, f"{doc.name} names files a clone does not have: {outside}"
    for link in links(doc):
        if re.match(r"[a-z]+:", link):
            continue
        target = (doc.parent / link).resolve()
        assert target.is_relative_to(ROOT) and target.exists(), f"{doc.name}: link {link}"


SECURITY = (ROOT / "docs" / "security.md").read_text()
UNITS = {"": 1, "s": 1, "ms": 1, "KiB": 1024, "MiB": 1024**2}


def test_security_md_limits_name_real_settings_with_their_defaults() -> None:
    defaults = Settings()
    checked = 0
    table = SECURITY.split("| limit | default | setting | over it |\n| --- | --- | --- | --- |\n")[
        1
    ]
    rows = table.split("\n\n")[0].splitlines()
    assert len(rows) > 20
    for row in rows:
        _, default, setting, _ = (cell.strip() for cell in row.strip("|").split(" | ", 3))
        names = re.findall(r"`([a-z]+(?:_[a-z]+)+)", setting)
        if setting.startswith("`[runner]"):
            assert set(names) <= RUNNER_KEYS, f"docs/security.md: {row}"
            continue
        names = [n for n in names if n != "rate_limit"]  # a [route] key
        assert set(names) <= Settings.model_fields.keys(), f"docs/security.md: {row}"
        number = re.fullmatch(r"(\d+)(?: (s|ms|MiB|KiB))?|2\^(\d+) \([\d,]+\)", default)
        if names and number:
            value = (
                int(number.group(1)) * UNITS[number.group(2) or ""]
                if number.group(1)
                else 2 ** int(number.group(3))
            )
            assert getattr(defaults, names[0]) == value, f"docs/security.md: {row}"
            checked += 1
    assert checked >= 8, checked


def test_error_messages_the_docs_quote_are_the_servers(bundled: ServerProcess) -> None:
    unknown = re.search(r"Triton's text, which its clients look for: `([^`]+)`", API)
    assert unknown, "docs/api.md: the unknown route's text"
    _, _, body = bundled.request("POST", "/v2/models/nowhere/infer", {"inputs": []})
    assert json.loads(body)["error"] == unknown.group(1).replace("<route>", "nowhere")
    plugins = (ROOT / "docs" / "plugins.md").read_text()
    cast = re.search(r"a 400 such as `(input 'x' is FP32; the request sent FP64)`", plugins)
    assert cast, "docs/plugins.md: the datatype error"
    request = {
        "inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP64", "data": [1, 2, 3, 4]}]
    }
    status, _, body = bundled.request("POST", "/v2/models/iris/infer", request)
    assert status == 400 and json.loads(body)["error"] == cast.group(1).replace("'x'", "'input'")
