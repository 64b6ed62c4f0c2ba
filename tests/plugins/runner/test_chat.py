"""The chat runner: prefill and batched steps on the committed recurrent model, sampling,
max_tokens and EOS, and continuous batching that changes no stream's tokens."""

from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from plugserve.registry.errors import InvalidInput
from plugserve.registry.manifest import load_manifest
from tests.plugins.bundled import MODELS, context, create_component, folder


@pytest.fixture(scope="module")
def chat() -> Any:
    return create_component("runner", "chat")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODELS / "chat/1/tokenizer.json"))


def request(
    tokenizer: Tokenizer,
    question: str,
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    ignore_eos: bool = False,
) -> dict[str, np.ndarray]:
    ids = tokenizer.encode(f"<|user|>\n{question}<|end|>\n<|assistant|>\n").ids
    return {
        "input_ids": np.array([ids], dtype=np.int64),
        "max_tokens": np.array([max_tokens], dtype=np.int32),
        "temperature": np.array([temperature], dtype=np.float32),
        "top_p": np.array([top_p], dtype=np.float32),
        "seed": np.array([seed], dtype=np.int64),
        "ignore_eos": np.array([ignore_eos], dtype=np.bool_),
    }


def alone(chat: Any, inputs: dict[str, np.ndarray]) -> list[int]:
    """One stream stepped by itself until it ends."""
    state = chat.start(inputs)
    tokens = []
    while (response := chat.step([state])[0]) is not None:
        assert response["token_id"].dtype == np.int64 and response["token_id"].shape == (1,)
        tokens.append(int(response["token_id"][0]))
    chat.stop(state)
    return tokens


def together(chat: Any, requests: list[dict[str, np.ndarray]], joins: list[int]) -> list[list[int]]:
    """The streams stepped as a server batches them: stream i joins before step joins[i],
    each step advances every stream in progress, a stream leaves when it answers None."""
    tokens: list[list[int]] = [[] for _ in requests]
    live: list[tuple[int, Any]] = []
    widest = step = 0
    while step <= max(joins) or live:
        live += [(i, chat.start(r)) for i, r in enumerate(requests) if joins[i] == step]
        widest = max(widest, len(live))
        responses = chat.step([state for _, state in live])
        for (i, state), response in zip(live, responses, strict=True):
            if response is None:
                chat.stop(state)
            else:
                tokens[i].append(int(response["token_id"][0]))
        live = [(i, s) for (i, s), r in zip(live, responses, strict=True) if r is not None]
        step += 1
    assert widest == len(requests)  # every stream was in one step with all the others
    return tokens


def test_the_route_serves_openai_chat_and_completions() -> None:
    manifest = load_manifest(folder("runner", "chat"))
    assert manifest.route is not None and manifest.runner is not None
    assert manifest.route.openai == ("chat", "completions")
    assert manifest.runner.max_batch_size == 32 and manifest.runner.max_streams == 64


@pytest.mark.parametrize(
    ("question", "answer"),
    [
        ("Hello!", "Hello! How can I help you today?"),
        ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ],
)
def test_greedy_answers_from_its_training_text_and_ends_at_eos(
    chat: Any, tokenizer: Tokenizer, question: str, answer: str
) -> None:
    tokens = alone(chat, request(tokenizer, question))
    assert tokenizer.decode(tokens) == answer
    assert len(tokens) < 64  # ended by <|end|>, which is not sent
    assert tokenizer.token_to_id("<|end|>") not in tokens


def test_greedy_is_deterministic_whatever_the_seed(chat: Any, tokenizer: Tokenizer) -> None:
    first = alone(chat, request(tokenizer, "Will it rain tomorrow?", seed=1))
    assert first == alone(chat, request(tokenizer, "Will it rain tomorrow?", seed=2))


def test_one_seed_one_text_and_other_seeds_other_texts(chat: Any, tokenizer: Tokenizer) -> None:
    def sampled(seed: int) -> list[int]:
        return alone(chat, request(tokenizer, "Tell me a joke.", 24, temperature=1.5, seed=seed))

    assert sampled(7) == sampled(7)
    assert len({tuple(sampled(seed)) for seed in range(6)}) > 1


def test_top_p_near_zero_is_greedy(chat: Any, tokenizer: Tokenizer) -> None:
    greedy = alone(chat, request(tokenizer, "Count to five."))
    assert (
        alone(chat, request(tokenizer, "Count to five.", temperature=1.5, top_p=1e-6, seed=3))
        == greedy
    )


def test_a_batched_step_gives_each_stream_the_tokens_it_gets_alone(
    chat: Any, tokenizer: Tokenizer
) -> None:
    """Continuous batching: three streams with their own prompts and settings, one joining
    mid-way, stepped together (one model call per step) give exactly their solo tokens."""
    requests = [
        request(tokenizer, "Hello!"),
        request(tokenizer, "Will it rain tomorrow?", 30, temperature=0.9, top_p=0.9, seed=3),
        request(tokenizer, "Tell me a joke.", 30, temperature=1.3, seed=3),
    ]
    solo = [alone(chat, r) for r in requests]
    assert all(len(tokens) > 3 for tokens in solo)
    assert together(chat, requests, joins=[0, 0, 3]) == solo


def test_max_tokens_is_obeyed(chat: Any, tokenizer: Tokenizer) -> None:
    full = alone(chat, request(tokenizer, "Hello!"))
    assert alone(chat, request(tokenizer, "Hello!", max_tokens=3)) == full[:3]
    assert len(alone(chat, request(tokenizer, "Tell me a joke.", 5, temperature=2.0, seed=4))) <= 5


def test_an_ended_stream_stays_ended_and_stop_drops_its_arrays(
    chat: Any, tokenizer: Tokenizer
) -> None:
    state = chat.start(request(tokenizer, "Hello!", max_tokens=1))
    assert chat.step([state])[0] is not None
    assert chat.step([state]) == [None]
    assert chat.step([state]) == [None]
    chat.stop(state)
    assert state.state is None and state.logits is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"input_ids": np.zeros((2, 3), np.int64)}, "shape [1, T>=1]"),
        ({"input_ids": np.zeros((1, 0), np.int64)}, "shape [1, T>=1]"),
        ({"input_ids": np.array([[1, 10**6]], np.int64)}, "input_ids must lie in [0, 500)"),
        ({"max_tokens": np.array([0], np.int32)}, "max_tokens must be at least 1"),
        ({"seed": np.array([1, 2], np.int64)}, "seed must hold one value"),
    ],
)
def test_validate_refuses_what_start_cannot_run(
    chat: Any, tokenizer: Tokenizer, change: dict[str, np.ndarray], message: str
) -> None:
    with pytest.raises(InvalidInput) as caught:
        chat.start({**request(tokenizer, "Hello!"), **change})
    assert message in str(caught.value)


async def test_the_route_streams_text_through_its_three_plugins(bundled: Any, chat: Any) -> None:
    template = await bundled("preprocessor", "chat_template")
    detokenize = await bundled("postprocessor", "detokenize")
    ctx = context("chat", {"temperature": 0})
    state = chat.start(template.process({"messages": [{"role": "user", "content": "Hello!"}]}, ctx))
    pieces = []
    while (response := chat.step([state])[0]) is not None:
        if (out := detokenize.format(response, ctx)) is not None:
            pieces.append(out["text_output"])
    chat.stop(state)
    assert "".join(pieces) == "Hello! How can I help you today?"
    assert len(pieces) > 3  # streamed, a piece per token


def test_ignore_eos_generates_max_tokens_whatever_the_model_says(
    chat: Any, tokenizer: Tokenizer
) -> None:
    """vLLM's ignore_eos (what the generation benchmark asks for): a stream that would end at
    <|end|> after a few tokens goes on to max_tokens, and never sends the end token."""
    ended = alone(chat, request(tokenizer, "Hello!", max_tokens=40))
    assert len(ended) < 40
    tokens = alone(chat, request(tokenizer, "Hello!", max_tokens=40, ignore_eos=True))
    assert len(tokens) == 40 and chat.eos not in tokens
    assert tokens[: len(ended)] == ended  # greedy: the same text, then more
