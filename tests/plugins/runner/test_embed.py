"""The embed runner: the committed encoder on the onnxruntime backend, as its route declares."""

from typing import Any

import numpy as np

from plugserve.registry.manifest import load_manifest
from tests.plugins.bundled import MODELS, PLUGINS, context, folder


def test_the_route_serves_openai_embeddings_through_tokenize_and_pool() -> None:
    route = load_manifest(folder("runner", "embed")).route
    assert route is not None
    assert route.name == "embed" and route.openai == ("embeddings",)
    assert [ref.name for ref in route.preprocess] == ["tokenize"]
    assert [ref.name for ref in route.postprocess] == ["pool"]


async def test_padding_and_batch_mates_change_no_real_token(bundled: Any) -> None:
    """The attention mask works: a text's hidden states are the same alone (16 wide) and
    beside a longer text (32 wide, more padding)."""
    tokenize = await bundled("preprocessor", "tokenize")
    embed = await bundled("runner", "embed")
    alone = tokenize.process({"input": "It will rain tomorrow."}, context())
    pair = tokenize.process(
        {
            "input": [
                "It will rain tomorrow.",
                "The cyclist climbed the mountain stage alone and won the yellow jersey in the rain.",
            ]
        },
        context(),
    )
    assert alone["input_ids"].shape[1] < pair["input_ids"].shape[1]
    one = embed.infer(alone)["last_hidden_state"]
    two = embed.infer(pair)["last_hidden_state"]
    assert one.shape == (1, alone["input_ids"].shape[1], 64) and one.dtype == np.float32
    real = int(alone["attention_mask"].sum())
    np.testing.assert_allclose(one[0, :real], two[0, :real], rtol=0, atol=1e-5)


async def test_the_served_route_answers_v2_infer_with_unit_vectors(client: Any) -> None:
    """The bundled folders served in-process: /v2/models/embed/infer with a BYTES text tensor."""
    cli = await client(plugins_dir=PLUGINS, models_dir=MODELS)
    texts = ["It will rain tomorrow.", "Boil the pasta."]
    body = {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": texts}]}
    resp = await cli.post("/v2/models/embed/infer", json=body)
    assert resp.status == 200, await resp.text()
    (out,) = (await resp.json())["outputs"]
    assert out["name"] == "embeddings" and out["shape"] == [2, 64]
    vectors = np.asarray(out["data"], dtype=np.float32).reshape(2, 64)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    bad = await cli.post(
        "/v2/models/embed/infer",
        json={**body, "inputs": [{**body["inputs"][0], "shape": [1], "data": [""]}]},
    )
    assert bad.status == 400 and "input 0 is an empty text" in await bad.text()
