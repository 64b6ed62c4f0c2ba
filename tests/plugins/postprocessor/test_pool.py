"""The pool postprocessor: masked mean of the runner's real output, L2-normalized."""

from typing import Any

import numpy as np

from tests.plugins.bundled import context

TEXTS = [
    "The weather today is sunny and warm.",
    "Tomorrow will be sunny and warm.",
    "The striker scored.",
]


async def test_unit_vectors_equal_a_numpy_mean_pool_of_the_runner_output(bundled: Any) -> None:
    tokenize = await bundled("preprocessor", "tokenize")
    embed = await bundled("runner", "embed")
    pool = await bundled("postprocessor", "pool")
    ctx = context("embed")
    inputs = tokenize.process({"input": TEXTS}, ctx)
    hidden = embed.infer(inputs)["last_hidden_state"]
    out = pool.format({"last_hidden_state": hidden}, ctx)["embeddings"]
    assert out.shape == (3, 64) and out.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-6)
    mask = inputs["attention_mask"]
    expected = np.stack(
        [hidden[i, : mask[i].sum()].mean(axis=0) for i in range(len(TEXTS))]
    )  # each row's real tokens only
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-6)
    padded_mean = hidden.mean(axis=1)  # what an unmasked pool would give: not this
    padded_mean /= np.linalg.norm(padded_mean, axis=1, keepdims=True)
    assert not np.allclose(out, padded_mean, atol=1e-3)


async def test_without_a_mask_every_position_counts(bundled: Any) -> None:
    pool = await bundled("postprocessor", "pool")
    hidden = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    out = pool.format({"last_hidden_state": hidden}, context())["embeddings"]
    mean = hidden.mean(axis=1)
    np.testing.assert_allclose(out, mean / np.linalg.norm(mean, axis=1, keepdims=True), atol=1e-6)
