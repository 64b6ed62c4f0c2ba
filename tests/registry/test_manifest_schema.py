"""``docs/schemas/plugin.schema.json``: the JSON Schema of ``plugin.toml`` that editors read,
made from the tables' declarations in ``registry/manifest.py``."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from plugserve.registry.errors import ManifestError
from plugserve.registry.manifest import load_manifest, manifest_schema
from tests.helpers import ROOT

SCHEMA = ROOT / "docs" / "schemas" / "plugin.schema.json"
VALIDATOR = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))


def _loads(folder: Path) -> bool:
    try:
        load_manifest(folder, check_layout=False)
    except ManifestError:
        return False
    return True


BUNDLED = sorted(
    path
    for pattern in (
        "plugins/**/plugin.toml",
        "examples/**/plugin.toml",
        "tests/fixtures/**/plugin.toml",
    )
    for path in ROOT.glob(pattern)
    if _loads(path.parent)
)


def test_the_published_manifest_schema_is_the_declared_one() -> None:
    """docs/schemas/plugin.schema.json is what ``python -m plugserve.registry.manifest``
    prints: regenerate it when a table changes."""
    assert json.loads(SCHEMA.read_text()) == manifest_schema()
    VALIDATOR.check_schema(manifest_schema())


def test_the_manifest_schema_takes_every_bundled_manifest() -> None:
    assert len(BUNDLED) >= 30
    for path in BUNDLED:
        errors = [e.message for e in VALIDATOR.iter_errors(tomllib.loads(path.read_text()))]
        assert not errors, (path, errors)


HEAD = "[plugin]\nname='iris'\nversion='1.0.0'\ntype='runner'\n"
RUNNER = HEAD + "[runner]\nbackend='onnxruntime'\n"
MODULE = HEAD + "module='plugin.py'\n[runner]\n"
STATE = RUNNER + "[[runner.sequence.state]]\ninput='s'\noutput='t'\n"

REFUSED = [
    # what the loader refuses and a JSON Schema can say: types, bounds, choices, keys (not
    # 1e3 for an integer: JSON Schema takes a float without a fraction as one)
    "",
    "[plugin]\nname='iris'\ntype='runner'\n",
    "[plugin]\nname='iris'\nversion='1.0.0'\ntype='model'\n",
    "[plugin]\nname='iris'\nversion=1\ntype='runner'\n",
    "[plugin]\nname='Iris'\nversion='1.0.0'\ntype='runner'\n",
    HEAD + "modul='x.py'\n",
    HEAD + "requires='numpy'\n",
    HEAD + f"module = '{'a/' * 600}p.py'\n",
    RUNNER + "max_batch_size=-1\n",
    RUNNER + "instances=9223372036854775807\n",
    RUNNER + "cast_inputs='yes'\n",
    RUNNER + "response_cache=1\n",
    RUNNER + "isolation='thread'\n",
    RUNNER + "isolation='process'\ndevice='gpu0'\n",
    RUNNER + "preferred_batch_sizes=[4, 0]\n",
    RUNNER + "tenant_weights=[1]\n",
    RUNNER + "tenant_weights={ gold = 0 }\n",
    RUNNER + "load='lazy'\n",
    RUNNER + "formats={ image = 'NCHW' }\n",
    RUNNER + "labels={ scores = 3 }\n",
    MODULE + "max_batch_sise=8\n",
    RUNNER + "[route]\n[runer]\nmax_batch_size=8\n",
    RUNNER + "[route]\npreprocess=5\n",
    RUNNER + "[route]\nname='Bad Name'\n",
    RUNNER + "[route]\nrate_limit={ rps = 1e-300 }\n",
    RUNNER + "[route]\nrate_limit={ rps = 1, burst = 9223372036854775807 }\n",
    RUNNER + "[route]\nrate_limit={ rps = 1, per = 's' }\n",
    RUNNER + "[route]\nopenai='speech'\n",
    RUNNER + "[route]\nopenai=['chat', 'speech']\n",
    RUNNER + "[processor]\ncots='size'\n",
    HEAD + "[processor]\ncost='cheap'\n",
    RUNNER + "[runner.sequence]\nidle_timeout=1\n",
    RUNNER + "[runner.sequence]\nidle_timeout_s=0\n",
    RUNNER + "[runner.sequence]\nmax_sequences=0\n",
    RUNNER + "[runner.sequence.controls]\ncorrid_datatype='INT32'\n",
    STATE + "datatype='BYTES'\nshape=[1]\n",
    STATE + "datatype='FP32'\nshape=[0]\n",
    STATE + "datatype='FP32'\nshape=[1]\nsize=2\n",
    RUNNER + "[[runner.sequence.state]]\noutput='t'\ndatatype='FP32'\nshape=[1]\n",
    RUNNER + "[runner.batching.inputs]\nx = { axis = 99 }\n",
    RUNNER + "[runner.batching.inputs]\nx = { ragged = 'stack' }\n",
    RUNNER + "[runner.batching.inputs]\nx = { ragged = 'pad', ragged_axes = [16] }\n",
    RUNNER + "[runner.batching.outputs]\ny = { axis = -1 }\n",
    RUNNER + "[runner.batching]\ncheck = 1\n",
    RUNNER + "[runner.batching]\ncheck = { rtol = -1 }\n",
    RUNNER + "[runner.batching]\ncheck = { tolerance = 1 }\n",
]


@pytest.mark.parametrize("text", REFUSED)
def test_the_manifest_schema_refuses_what_the_loader_refuses(plugins_dir: Path, text: str) -> None:
    """An editor validating against the published schema flags what the server refuses."""
    folder = plugins_dir / "runner" / "iris" / "1.0.0"
    folder.mkdir(parents=True)
    (folder / "plugin.toml").write_text(text)
    (folder / "plugin.py").write_text("")
    with pytest.raises(ManifestError):
        load_manifest(folder)
    document: dict[str, Any] = tomllib.loads(text)
    assert not VALIDATOR.is_valid(document), text


def test_a_backend_s_own_runner_keys_are_the_schema_s_to_let_pass() -> None:
    """A backend declares keys of its own: with one, ``[runner]`` takes any key."""
    document = tomllib.loads(RUNNER + "intra_op_threads = 2\n")
    assert VALIDATOR.is_valid(document)
    assert not VALIDATOR.is_valid(tomllib.loads(MODULE + "intra_op_threads = 2\n"))
