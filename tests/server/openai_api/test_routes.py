"""The official ``openai`` client, unchanged, against a real server (``base_url``, ``api_key``):
models, embeddings, chat and completions, streamed or not, errors, and hang-ups."""

import base64
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import openai
import pytest

from tests.helpers import ServerProcess
from tests.server.openai_api.plugins import write_failing_choices, write_openai_plugins

pytestmark = pytest.mark.slow


def client(proc: ServerProcess, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key=key, max_retries=0, timeout=20)


@pytest.fixture
def served(plugins_dir: Path, server: Callable[..., ServerProcess]) -> ServerProcess:
    write_openai_plugins(plugins_dir)
    return server("--plugins-dir", str(plugins_dir))


@pytest.mark.workers(1, 2)
def test_models_and_embeddings(served: ServerProcess) -> None:
    api = client(served)
    models = {m.id: m for m in api.models.list()}
    assert set(models) == {"talk", "vec"}  # routes without [route] openai are not listed
    assert api.models.retrieve("vec").id == "vec"
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("nope")

    one = api.embeddings.create(model="vec", input="hello there")
    assert one.data[0].embedding == [11.0, 4.0, 1.0] and one.data[0].index == 0
    assert one.usage.prompt_tokens == 2 and one.usage.total_tokens == 2
    assert one.model == "vec"
    many = api.embeddings.create(model="vec", input=["a", "bcd", "eeee"])
    assert [d.embedding for d in many.data] == [[1, 1, 1], [3, 0, 1], [4, 4, 1]]
    assert [d.index for d in many.data] == [0, 1, 2]
    # The client asks for base64 by default when numpy is there; ask explicitly both ways.
    raw = api.embeddings.with_raw_response.create(
        model="vec", input=["abc"], encoding_format="base64"
    )
    packed = json.loads(raw.text)["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(packed), "<f4").tolist() == [3.0, 1.0, 1.0]
    short = api.embeddings.create(model="vec", input="aaaa", dimensions=2)
    assert short.data[0].embedding == pytest.approx([4 / 32**0.5, 4 / 32**0.5])


@pytest.mark.workers(1, 2)
def test_chat_completions_whole_and_streamed(served: ServerProcess) -> None:
    api = client(served)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi you"}]
    reply = api.chat.completions.create(model="talk", messages=messages, max_tokens=4)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == "t1 t2 t3 t4 "
    assert choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (4, 4)
    assert reply.usage.total_tokens == 8 and reply.model == "talk"
    assert reply.system_fingerprint == "talk@1.0.0" and reply.id.startswith("chatcmpl-")
    # The chain's own cap (8 when none is asked for) is a length too; a stop sequence is a stop.
    assert (
        api.chat.completions.create(model="talk", messages=messages).choices[0].finish_reason
        == "length"
    )
    stopped = api.chat.completions.create(model="talk", messages=messages, stop=["t3", "zz"])
    assert (
        stopped.choices[0].message.content == "t1 t2 "
        and stopped.choices[0].finish_reason == "stop"
    )
    assert stopped.usage.completion_tokens == 3  # the stream stopped at the token that matched

    chunks = list(
        api.chat.completions.create(
            model="talk", messages=messages, max_tokens=3, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "t1 t2 t3 "
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    # Two choices, with seeds of their own; a text content-part list reads as its text.
    parts = [{"role": "user", "content": [{"type": "text", "text": "a b c"}]}]
    two = api.chat.completions.create(model="talk", messages=parts, n=2, max_tokens=2, seed=7)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.usage.prompt_tokens == 3 and two.usage.completion_tokens == 4


def test_completions_whole_and_streamed(served: ServerProcess) -> None:
    api = client(served)
    done = api.completions.create(model="talk", prompt="one two", max_tokens=2, echo=True)
    assert done.choices[0].text == "one twot1 t2 " and done.choices[0].finish_reason == "length"
    assert done.object == "text_completion" and done.usage.prompt_tokens == 2
    several = api.completions.create(model="talk", prompt=["a", "b c"], max_tokens=1, n=2)
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.usage.prompt_tokens == 3 and several.usage.completion_tokens == 4
    streamed = list(
        api.completions.create(model="talk", prompt="x", max_tokens=5, stop="t4", stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == "t1 t2 t3 "
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_errors_come_in_openai_shape_with_their_status(served: ServerProcess) -> None:
    api = client(served)
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as unknown:
        api.chat.completions.create(model="nope", messages=user)
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):  # a route not declared for chat
        api.chat.completions.create(model="vec", messages=user)
    with pytest.raises(openai.NotFoundError):
        api.embeddings.create(model="talk", input="x")
    for bad in (
        {"temperature": 3},
        {"max_tokens": 0},
        {"stop": ["a", "b", "c", "d", "e"]},
        {"n": 99},
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"response_format": {"type": "json_object"}},
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(model="talk", messages=user, **bad)  # type: ignore[call-overload]
        assert refused.value.param == next(iter(bad)), refused.value
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model="talk", messages=[{"role": "robot", "content": "x"}])  # type: ignore[list-item]
    with pytest.raises(openai.BadRequestError):
        api.embeddings.create(model="vec", input=[])
    # A preprocessor's refusal is a 400 before the stream begins.
    with pytest.raises(openai.BadRequestError) as forbidden:
        api.chat.completions.create(
            model="talk", messages=[{"role": "user", "content": "forbidden"}], stream=True
        )
    assert "forbidden" in forbidden.value.message
    status, _, body = served.request("GET", "/v1/nothing")
    assert status == 404 and json.loads(body)["error"]["type"] == "invalid_request_error"
    status, _, body = served.request(
        "POST", "/v1/chat/completions", b"{", {"Content-Type": "application/json"}
    )
    assert status == 400 and "message" in json.loads(body)["error"]


def test_the_inference_token_is_the_api_key(
    plugins_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_openai_plugins(plugins_dir)
    proc = server("--plugins-dir", str(plugins_dir), env={"PLUGSERVE_INFERENCE_TOKEN": "sesame"})
    with pytest.raises(openai.AuthenticationError):
        client(proc, "wrong").models.list()
    assert [m.id for m in client(proc, "sesame").models.list()] == ["talk", "vec"]
    reply = client(proc, "sesame").chat.completions.create(
        model="talk", messages=[{"role": "user", "content": "x"}], max_tokens=1
    )
    assert reply.choices[0].message.content == "t1 "


def test_a_client_that_leaves_a_chat_stream_stops_generation(
    plugins_dir: Path, tmp_path: Path, server: Callable[..., ServerProcess]
) -> None:
    log = tmp_path / "steps.log"
    write_openai_plugins(plugins_dir, step_s=0.1, log=log)
    proc = server("--plugins-dir", str(plugins_dir))
    with client(proc).chat.completions.create(
        model="talk", messages=[{"role": "user", "content": "go"}], max_tokens=500, stream=True
    ) as stream:
        texts = []
        for chunk in stream:
            texts.append(chunk.choices[0].delta.content)
            if len(texts) == 4:  # the role, then three tokens
                break
    time.sleep(1.0)  # ten steps' time
    lines = log.read_text().splitlines()
    assert 3 <= len([line for line in lines if line.startswith("step")]) <= 5, lines
    assert lines[-1] == "stop"
    time.sleep(0.3)
    assert log.read_text().splitlines() == lines


def stopped_steps(log: Path) -> list[str]:
    """The runner's log once it has settled: it ends with the stop of the choice that was
    streaming, and no step comes after the answer."""
    time.sleep(0.5)  # five steps' time
    lines = log.read_text().splitlines()
    time.sleep(0.5)
    assert log.read_text().splitlines() == lines
    return lines


def test_choices_failing_together_end_with_the_ranked_error_and_stop_the_others(
    plugins_dir: Path, tmp_path: Path, server: Callable[..., ServerProcess]
) -> None:
    """Three prompts: one streams 500 tokens, two fail 0.3 s in, the client's 400 first and
    the plugin's fault beside it. The request is the fault's 500, whole or streamed, and
    the choice still streaming stops when the request ends: no step after its answer."""
    log = tmp_path / "steps.log"
    write_failing_choices(plugins_dir, log)
    proc = server("--plugins-dir", str(plugins_dir))
    prompts = ["go", "refuse", "crash"]
    with pytest.raises(openai.InternalServerError, match="crashed"):
        client(proc).completions.create(model="mixed", prompt=prompts)
    lines = stopped_steps(log)
    assert any(line.startswith("step") for line in lines), lines  # it had begun
    assert lines[-1] == "stop"

    log.write_text("")
    stream = client(proc).completions.create(model="mixed", prompt=prompts, stream=True)
    chunks = [next(stream)]  # the stream has begun: the error comes as its last event
    with pytest.raises(openai.APIError, match="crashed"):
        chunks.extend(stream)
    lines = stopped_steps(log)
    assert any(line.startswith("step") for line in lines), lines  # it had begun
    assert lines[-1] == "stop"
