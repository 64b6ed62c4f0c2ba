"""The detokenize postprocessor: streamed deltas that add up to the decoded text, whole characters only."""

from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.plugins.bundled import MODELS, context


@pytest.fixture
async def detokenize(bundled: Any) -> Any:
    return await bundled("postprocessor", "detokenize")


@pytest.fixture
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODELS / "chat/1/tokenizer.json"))


def stream(detokenize: Any, ids: list[int]) -> list[str | None]:
    ctx = context("chat")
    sent = []
    for token in ids:
        out = detokenize.format({"token_id": np.array([token], dtype=np.int64)}, ctx)
        sent.append(None if out is None else out["text_output"])
    return sent


def test_deltas_add_up_to_the_text_and_split_characters_wait(
    detokenize: Any, tokenizer: Tokenizer
) -> None:
    text = "Café 🙂 and naïve 日本 done."
    assert len(tokenizer.encode("🙂").ids) > 1  # an emoji's four bytes span several tokens
    ids = tokenizer.encode(text).ids
    sent = stream(detokenize, ids)
    assert "".join(s for s in sent if s is not None) == tokenizer.decode(ids) == text
    assert None in sent  # while a character was incomplete, nothing was sent
    assert not any(s is not None and "\ufffd" in s for s in sent)


def test_each_token_of_plain_text_sends_its_own_text(detokenize: Any, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello! How can I help you today?").ids
    sent = stream(detokenize, ids)
    assert sent == [
        tokenizer.decode(ids[: i + 1])[len(tokenizer.decode(ids[:i])) :] for i in range(len(ids))
    ]


def test_special_tokens_send_nothing(detokenize: Any, tokenizer: Tokenizer) -> None:
    end = tokenizer.token_to_id("<|end|>")
    assert end is not None
    sent = stream(detokenize, [*tokenizer.encode("Hi").ids, end])
    assert "".join(s for s in sent if s) == "Hi"
    assert sent[-1] is None
