"""The bundled examples as a plain ``plugserve serve`` serves them (the repository's plugins/
and models/), called by the official openai client and by Triton's generate extension."""

import json
from collections.abc import Callable

import numpy as np
import openai
import pytest

from tests.helpers import ROOT, ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture
def bundled(server: Callable[..., ServerProcess]) -> ServerProcess:
    plugins, models = ROOT / "plugins", ROOT / "models"
    return server("--plugins-dir", str(plugins), "--models-dir", str(models))


@pytest.mark.workers(1, 2)
def test_embed_chat_and_iris_are_served_side_by_side(bundled: ServerProcess) -> None:
    api = openai.OpenAI(base_url=bundled.url + "/v1", api_key="unused", max_retries=0)
    assert {m.id for m in api.models.list()} == {"chat", "embed"}

    texts = ["The server batches requests.", "It rained all day in the city.", "x"]
    vectors = api.embeddings.create(model="embed", input=texts, encoding_format="float")
    matrix = np.array([d.embedding for d in vectors.data])
    assert matrix.shape == (3, 64) and np.allclose(np.linalg.norm(matrix, axis=1), 1, atol=1e-5)
    assert vectors.usage.prompt_tokens > len(texts)
    one = api.embeddings.create(model="embed", input=texts[1], encoding_format="float")
    assert np.allclose(one.data[0].embedding, matrix[1], atol=1e-5)  # batch-mates change nothing

    hello = [{"role": "user", "content": "Hello!"}]
    reply = api.chat.completions.create(model="chat", messages=hello, temperature=0)
    assert reply.choices[0].message.content == "Hello! How can I help you today?"
    assert reply.choices[0].finish_reason == "stop"  # the model's own end
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in api.chat.completions.create(
            model="chat", messages=hello, temperature=0, stream=True
        )
        if chunk.choices
    ]
    assert "".join(pieces) == "Hello! How can I help you today?" and len(pieces) > 4
    capped = api.chat.completions.create(model="chat", messages=hello, max_tokens=3, temperature=0)
    assert capped.choices[0].finish_reason == "length" and capped.usage.completion_tokens == 3
    done = api.completions.create(model="chat", prompt="<|user|>\nHello!<|end|>\n<|assistant|>\n",
                                  temperature=0, max_tokens=40)  # fmt: skip
    assert done.choices[0].text == "Hello! How can I help you today?"

    status, _, body = bundled.request(
        "POST", "/v2/models/chat/generate_stream",
        {"text_input": "<|user|>\nHello!<|end|>\n<|assistant|>\n", "parameters": {"temperature": 0}},
    )  # fmt: skip
    assert status == 200, body
    events = [json.loads(e[6:]) for e in body.decode().split("\n\n") if e]
    assert "".join(e["text_output"] for e in events) == "Hello! How can I help you today?"
    status, _, body = bundled.request("POST", "/predict/iris", {"input": [[5.1, 3.5, 1.4, 0.2]]})
    assert status == 200 and json.loads(body)["label"] == ["setosa"], body


def test_every_int64_seed_gives_each_of_n_choices_a_seed_of_its_own(
    bundled: ServerProcess,
) -> None:
    """Issue 29 finding 8: ``seed = 2**63-1`` with ``n = 2`` was a 400 from the chat
    preprocessor (choice 1 got ``seed + 1``, past the 64-bit range). Choice ``i`` gets
    ``seed + i`` wrapped into the signed range: choice 1 of ``2**63-1`` answers as a
    request of ``-2**63`` alone does, over chat and completions; the variant, two prompts
    times n = 2 from ``2**63-2``, wraps choices 2 and 3."""
    api = openai.OpenAI(base_url=bundled.url + "/v1", api_key="unused", max_retries=0)
    top, bottom = 2**63 - 1, -(2**63)
    hello = [{"role": "user", "content": "Hello!"}]
    sampled = {"temperature": 1.5, "max_tokens": 12}
    two = api.chat.completions.create(model="chat", messages=hello, n=2, seed=top, **sampled)
    assert [c.index for c in two.choices] == [0, 1]
    alone = api.chat.completions.create(model="chat", messages=hello, seed=bottom, **sampled)
    first = api.chat.completions.create(model="chat", messages=hello, seed=top, **sampled)
    assert two.choices[1].message.content == alone.choices[0].message.content
    assert two.choices[0].message.content == first.choices[0].message.content

    prompt = "<|user|>\nHello!<|end|>\n<|assistant|>\n"
    done = api.completions.create(model="chat", prompt=prompt, n=2, seed=top, **sampled)
    assert [c.index for c in done.choices] == [0, 1]
    wrapped = api.completions.create(model="chat", prompt=prompt, seed=bottom, **sampled)
    assert done.choices[1].text == wrapped.choices[0].text

    other = "<|user|>\nWhat is it?<|end|>\n<|assistant|>\n"
    four = api.completions.create(
        model="chat", prompt=[prompt, other], n=2, seed=top - 1, **sampled
    )
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    third = api.completions.create(model="chat", prompt=other, seed=bottom + 1, **sampled)
    assert four.choices[3].text == third.choices[0].text
