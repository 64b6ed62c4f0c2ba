"""``[processor]``: what a processor's cost follows, and so whether its calls may run on
the event loop."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugserve.registry.errors import ManifestError
from plugserve.registry.manifest import load_manifest
from tests.helpers import ROOT, write_plugin


def test_a_processor_s_cost_follows_its_content_unless_it_says_size(plugins_dir: Path) -> None:
    plain = write_plugin(plugins_dir, "preprocessor", "plain", "1.0.0")
    sized = write_plugin(plugins_dir, "postprocessor", "sized", "1.0.0",
                         '[processor]\ncost = "size"\n')  # fmt: skip
    assert load_manifest(plain).processor.cost == "content"
    assert not load_manifest(plain).processor.sized
    assert load_manifest(sized).processor.sized


@pytest.mark.parametrize(
    ("kind", "table", "field"),
    [
        ("preprocessor", '[processor]\ncost = "cheap"\n', "processor.cost"),
        ("preprocessor", '[processor]\ncots = "size"\n', "processor"),
        ("runner", '[runner]\nbackend = "onnxruntime"\n[processor]\ncost = "size"\n', "processor"),
    ],
)
def test_a_wrong_processor_table_names_its_field(
    plugins_dir: Path, kind: str, table: str, field: str
) -> None:
    folder = write_plugin(plugins_dir, kind, "p", "1.0.0", table)
    with pytest.raises(ManifestError) as raised:
        load_manifest(folder)
    assert raised.value.fields.get("field") == field


def test_bundled_processors_declare_a_cost_by_size_only_where_it_holds() -> None:
    """Compressed images (a few bytes, megapixels) and a stream decoded whole at each token
    do not; the others' cost is linear in the bytes they read."""
    sized = {
        folder.parent.name: load_manifest(folder).processor.sized
        for kind in ("preprocessor", "postprocessor")
        for folder in (ROOT / "plugins" / kind).glob("*/*")
    }
    assert sized == {
        "image_decode": False, "detokenize": False, "scale": True, "tokenize": True,
        "chat_template": True, "label": True, "pool": True,
    }  # fmt: skip
