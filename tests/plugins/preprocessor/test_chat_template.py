"""The chat_template preprocessor: the template, raw prompts, generation settings and refusals."""

from typing import Any

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer

from plugserve.registry.errors import InvalidInput
from tests.plugins.bundled import MODELS, context


@pytest.fixture
async def template(bundled: Any) -> Any:
    return await bundled("preprocessor", "chat_template")


@pytest.fixture
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODELS / "chat/1/tokenizer.json"))


def test_messages_are_rendered_as_the_model_was_trained(
    template: Any, tokenizer: Tokenizer
) -> None:
    """models/chat/build.py renders its dialogues this way: the ids must be the same."""
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is "},
                {"type": "text", "text": "two plus two?"},
            ],
        },
    ]
    ctx = context("chat")
    out = template.process({"messages": messages}, ctx)
    text = "<|system|>\nAnswer briefly.<|end|>\n<|user|>\nWhat is two plus two?<|end|>\n<|assistant|>\n"
    assert out["input_ids"].tolist() == [tokenizer.encode(text).ids]
    assert out["input_ids"].dtype == np.int64
    assert ctx.usage["prompt_tokens"] == out["input_ids"].shape[1]


def test_a_tag_typed_in_a_message_is_text_not_a_tag(template: Any, tokenizer: Tokenizer) -> None:
    out = template.process({"messages": [{"role": "user", "content": "hi<|end|>"}]}, context())
    end = tokenizer.token_to_id("<|end|>")
    assert out["input_ids"][0].tolist().count(end) == 1  # the template's own, not the user's


@pytest.mark.parametrize("key", ["prompt", "text_input"])
def test_raw_prompts_take_no_template(template: Any, tokenizer: Tokenizer, key: str) -> None:
    out = template.process({key: "<|user|>\nHello!<|end|>\n"}, context())
    assert out["input_ids"].tolist() == [tokenizer.encode("<|user|>\nHello!<|end|>\n").ids]


def test_a_v2_text_input_tensor_is_a_prompt(template: Any) -> None:
    v2 = template.process({"text_input": np.array([b"Hello"], dtype=object)}, context())
    raw = template.process({"prompt": "Hello"}, context())
    assert np.array_equal(v2["input_ids"], raw["input_ids"])


def test_defaults(template: Any) -> None:
    ctx = context()
    out = template.process({"prompt": "Hello"}, ctx)
    assert out["max_tokens"].tolist() == [64] and out["max_tokens"].dtype == np.int32
    assert out["temperature"].tolist() == [1.0] and out["temperature"].dtype == np.float32
    assert out["top_p"].tolist() == [1.0] and out["top_p"].dtype == np.float32
    assert out["seed"].dtype == np.int64
    seeds = {int(template.process({"prompt": "Hello"}, context())["seed"][0]) for _ in range(4)}
    assert len(seeds) > 1  # random when not given
    assert ctx.state["max_tokens"] == 64


def test_settings_from_parameters_and_from_the_body(template: Any) -> None:
    parameters = {"max_tokens": 5, "temperature": 0, "top_p": 0.5, "seed": -3}
    out = template.process({"prompt": "Hi"}, context(parameters=parameters))
    assert [out[k][0].item() for k in ("max_tokens", "temperature", "top_p", "seed")] == [
        5,
        0.0,
        0.5,
        -3,
    ]
    body = {"text_input": "Hi", "max_tokens": np.array([7], dtype=np.int32), "temperature": 0.25}
    out = template.process(body, context())  # Triton's generate: settings beside the text
    assert out["max_tokens"].tolist() == [7] and out["temperature"].tolist() == [0.25]
    out = template.process({"prompt": "Hi"}, context(parameters={"max_completion_tokens": 9}))
    assert out["max_tokens"].tolist() == [9]


@pytest.mark.parametrize(
    ("data", "parameters", "message"),
    [
        ("text", {}, 'expects a JSON object with "messages"'),
        ({"input": "x"}, {}, 'expects "messages" (chat), "prompt" or "text_input"'),
        ({"messages": []}, {}, "messages must be a non-empty list"),
        ({"messages": ["hi"]}, {}, "messages[0] must be an object"),
        (
            {"messages": [{"role": "robot", "content": "x"}]},
            {},
            "messages[0].role must be system, user or assistant; got 'robot'",
        ),
        (
            {"messages": [{"role": "user", "content": 5}]},
            {},
            "messages[0].content must be a UTF-8 string",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            {},
            "messages[0].content[0] must be a text part",
        ),
        ({"prompt": ["a", "b"]}, {}, "prompt must be a UTF-8 string"),
        ({"prompt": ""}, {}, "the prompt is empty"),
        ({"prompt": "\ud800"}, {}, "prompt is not valid UTF-8"),
        (
            {"text_input": np.array([b"\xff"], dtype=object)},
            {},
            "text_input must be a UTF-8 string",
        ),
        ({"prompt": "hi " * 1100}, {}, "at most 1024 are allowed"),
        ({"prompt": "x"}, {"max_tokens": 0}, "max_tokens must be an integer from 1 to 512; got 0"),
        ({"prompt": "x"}, {"max_tokens": 513}, "max_tokens must be an integer from 1 to 512"),
        ({"prompt": "x"}, {"max_tokens": 2.5}, "max_tokens must be an integer"),
        (
            {"prompt": "x"},
            {"max_completion_tokens": True},
            "max_completion_tokens must be an integer",
        ),
        ({"prompt": "x", "max_tokens": "many"}, {}, "max_tokens must be an integer"),
        (
            {"prompt": "x"},
            {"temperature": 2.5},
            "temperature must be a number from 0 to 2; got 2.5",
        ),
        ({"prompt": "x"}, {"temperature": "hot"}, "temperature must be a number"),
        ({"prompt": "x"}, {"top_p": 0}, "top_p must be above 0"),
        ({"prompt": "x"}, {"top_p": 1.5}, "top_p must be a number from 0 to 1"),
        ({"prompt": "x"}, {"seed": 1.5}, "seed must be a 64-bit integer"),
        ({"prompt": "x"}, {"seed": 2**64}, "seed must be a 64-bit integer"),
    ],
)
def test_refusals_name_the_field(
    template: Any, data: Any, parameters: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidInput) as caught:
        template.process(data, context(parameters=parameters))
    assert message in str(caught.value)


def test_a_prompt_certainly_too_long_is_refused_before_it_is_tokenized(
    template: Any, tokenizer: Tokenizer, monkeypatch: Any
) -> None:
    """Issue 29 finding 1: a 30 MiB message was tokenized whole (24-38 s, 5.5 GB) before
    its 400. No token of the vocabulary covers more than 13 characters: a prompt of more
    than 1024 * 13 is refused without a call to the tokenizer; many medium messages (the
    variant) stop at the first that passes the limit."""
    assert template.token_chars == max(map(len, tokenizer.get_vocab(with_added_tokens=True)))
    calls: list[int] = []

    class Counted:
        def __init__(self, real: Any) -> None:
            self.real = real

        def encode(self, text: str) -> Any:
            calls.append(len(text))
            return self.real.encode(text)

    monkeypatch.setattr(template, "text", Counted(template.text))
    monkeypatch.setattr(template, "raw", Counted(template.raw))
    big = "x" * (1024 * 13 + 1)
    for data in ({"messages": [{"role": "user", "content": big}]}, {"prompt": big}):
        with pytest.raises(InvalidInput, match="at least 102[58] tokens .* at most 1024 are"):
            template.process(data, context())
    assert calls == []
    # 2 tags a message: 600 empty messages certainly make more than 1024 tokens.
    with pytest.raises(InvalidInput, match="at least 1201 tokens"):
        template.process({"messages": [{"role": "user", "content": ""}] * 600}, context())
    assert calls == []
    medium = [{"role": "user", "content": "hi " * 400}] * 5  # 6,000 characters, 3,000 tokens
    with pytest.raises(InvalidInput, match="over 1024 tokens .* at most 1024 are allowed"):
        template.process({"messages": medium}, context())
    assert len(calls) <= 4  # the newline, then two messages


def test_a_prompt_near_the_limit_is_tokenized_and_counted_exactly(
    template: Any, tokenizer: Tokenizer
) -> None:
    """Not certainly over: tokenized, and the exact count decides."""
    text = "a" * 1024  # one token a character: not merged in this vocabulary
    assert len(tokenizer.encode(text).ids) == 1024
    ctx = context()
    assert template.process({"prompt": text}, ctx)["input_ids"].shape == (1, 1024)
    with pytest.raises(InvalidInput, match="the prompt is 1025 tokens"):
        template.process({"prompt": text + "a"}, context())


def test_too_many_messages_are_refused_before_any_is_read(template: Any, monkeypatch: Any) -> None:
    """Issue 29, from the attack on finding 1's fix: 2 M messages were each checked and
    measured (``_turn``) before the character bound could refuse them, a cost that grew with
    the count alone. Each message takes two tokens at least: past the limit on the count
    alone, none is read."""
    read: list[int] = []
    real = template._turn
    monkeypatch.setattr(template, "_turn", lambda m, i, ctx: read.append(i) or real(m, i, ctx))
    with pytest.raises(InvalidInput, match=r"at least 1025 tokens \(512 messages\)"):
        template.process({"messages": [{"role": "user", "content": "hi"}] * 512}, context())
    assert read == []
    assert template.process({"messages": [{"role": "user", "content": "hi"}] * 100}, context())
    assert len(read) == 100


def test_no_character_bound_where_an_added_token_strips_spaces(template: Any) -> None:
    """From the review of issue 29 finding 1's fix: an added token with ``lstrip`` or
    ``rstrip`` (role tags often have it) takes in any run of spaces beside it, so a long
    text can make two tokens; the bound would have refused prompts that fit."""
    tokenizer = Tokenizer.from_file(str(MODELS / "chat" / "1" / "tokenizer.json"))
    token_chars = type(template).__init__.__globals__["token_chars"]
    assert token_chars(tokenizer) == 13
    tokenizer.add_tokens([AddedToken("<|x|>", lstrip=True, rstrip=True)])
    assert len(tokenizer.encode("<|x|>" + " " * 10_000 + "<|x|>").ids) == 2
    assert token_chars(tokenizer) is None
