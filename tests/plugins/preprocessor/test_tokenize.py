"""The tokenize preprocessor: OpenAI and v2 inputs, padding to multiples of 16, masks, usage, refusals."""

import importlib.util
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from plugserve.registry.errors import InvalidInput
from tests.plugins.bundled import MODELS, context, folder


@pytest.fixture
async def tokenize(bundled: Any) -> Any:
    return await bundled("preprocessor", "tokenize")


@pytest.fixture
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODELS / "embed/1/tokenizer.json"))


def test_one_text_is_framed_padded_to_16_and_counted(tokenize: Any, tokenizer: Tokenizer) -> None:
    ctx = context()
    out = tokenize.process({"input": "The weather is sunny today."}, ctx)
    ids = tokenizer.encode("The weather is sunny today.").ids
    assert ids[0] == tokenizer.token_to_id("[CLS]") and ids[-1] == tokenizer.token_to_id("[SEP]")
    assert out["input_ids"].dtype == np.int64 and out["attention_mask"].dtype == np.int64
    assert out["input_ids"].shape == (1, 16)
    assert out["input_ids"][0, : len(ids)].tolist() == ids
    assert (out["input_ids"][0, len(ids) :] == tokenizer.token_to_id("[PAD]")).all()
    assert out["attention_mask"][0].tolist() == [1] * len(ids) + [0] * (16 - len(ids))
    assert ctx.usage["prompt_tokens"] == len(ids)
    assert ctx.state["attention_mask"] is out["attention_mask"]


def test_a_batch_pads_to_its_longest_rounded_up(tokenize: Any, tokenizer: Tokenizer) -> None:
    texts = [
        "Rain.",
        "Boil the pasta in plenty of salted water until it is just tender, then serve.",
    ]
    ctx = context()
    out = tokenize.process({"input": texts}, ctx)
    lengths = [len(tokenizer.encode(t).ids) for t in texts]
    assert max(lengths) > 16
    assert out["input_ids"].shape == (2, 32)
    assert out["attention_mask"].sum(axis=1).tolist() == lengths
    assert ctx.usage["prompt_tokens"] == sum(lengths)


def test_long_texts_are_cut_at_max_length(tokenize: Any) -> None:
    out = tokenize.process({"input": ["word " * 500, "short"]}, context())
    assert out["input_ids"].shape == (2, 128)
    assert out["attention_mask"][0].sum() == 128


def test_token_id_lists_are_used_as_given(tokenize: Any) -> None:
    ctx = context()
    out = tokenize.process({"input": [[5, 6, 7], [8]]}, ctx)
    assert out["input_ids"][:, :3].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out["attention_mask"].sum() == 4 and ctx.usage["prompt_tokens"] == 4
    single = tokenize.process({"input": [5, 6, 7]}, context())  # one text as token ids
    assert single["input_ids"].shape == (1, 16)


def test_a_v2_bytes_tensor_is_texts(tokenize: Any) -> None:
    text = np.array(["café au lait".encode(), b"rain"], dtype=object)
    v2 = tokenize.process({"text": text}, context())
    openai = tokenize.process({"input": ["café au lait", "rain"]}, context())
    assert np.array_equal(v2["input_ids"], openai["input_ids"])
    assert tokenize.metadata()["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"texts": ["a"]}, 'expects {"input"'),
        (b"raw body", 'expects {"input"'),
        ({"input": ""}, "input 0 is an empty text"),
        ({"input": []}, "non-empty list"),
        ({"input": ["ok", ""]}, "input 1 is an empty text"),
        ({"input": [[]]}, "input 0 is an empty token list"),
        ({"input": [1.5]}, "input 0 is neither"),
        ({"input": [[1, 2], [1000000]]}, "input 1: token ids must lie in [0, 1000)"),
        ({"input": ["x"] * 257}, "at most 256 inputs per request; got 257"),
        ({"input": "\ud800"}, "input 0 is not valid UTF-8"),
        ({"input": {"a": 1}}, "non-empty list"),
        ({"text": np.array([b"ok", b"\xff\xfe"], dtype=object)}, "text 1 is not valid UTF-8"),
    ],
)
def test_refusals_are_invalid_input_with_a_clear_message(
    tokenize: Any, data: Any, message: str
) -> None:
    with pytest.raises(InvalidInput) as caught:
        tokenize.process(data, context())
    assert message in str(caught.value)


def test_token_type_ids_for_bert_style_encoders(tokenizer: Tokenizer) -> None:
    """``token_type_ids = true``: zeros beside the ids (what optimum's BERT exports take)."""
    spec = importlib.util.spec_from_file_location(
        "tokenize_plugin", folder("preprocessor", "tokenize") / "plugin.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tokenize = module.Tokenize(tokenizer, 128, 256, "[PAD]", token_type_ids=True)
    out = tokenize.process({"input": ["a b", "c"]}, context())
    assert out["token_type_ids"].shape == out["input_ids"].shape
    assert out["token_type_ids"].dtype == np.int64 and not out["token_type_ids"].any()


def test_a_long_text_is_cut_before_it_is_tokenized_and_its_ids_are_unchanged(
    tokenize: Any, tokenizer: Tokenizer, monkeypatch: Any
) -> None:
    """Issue 29 finding 1: a multi-MiB text was tokenized whole (6 s for 4 MiB) to keep its
    first 128 tokens. The tokenizer sees a prefix of at most 2 * 128 * the longest token;
    the ids are those of the whole text, for a normal text, a long one, and one whose
    first characters the normalizer drops (the variant: a longer prefix is needed)."""
    tokenizer.enable_truncation(128)
    words = (MODELS.parent / "models" / "embed" / "corpus.txt").read_text()
    seen: list[int] = []
    real = tokenize.tokenizer

    class Counted:
        def encode(self, text: str) -> Any:
            seen.append(len(text))
            return real.encode(text)

        def encode_batch(self, texts: list[str]) -> Any:
            seen.extend(map(len, texts))
            return real.encode_batch(texts)

    monkeypatch.setattr(tokenize, "tokenizer", Counted())
    short, long = words[:300], (words * 1000)[: 4 * 1024 * 1024]
    controls = "\x01" * 20_000 + words * 3  # clean_text drops control characters
    for text in (short, long, controls):
        seen.clear()
        out = tokenize.process({"input": [text, "x"]}, context())
        expected = tokenizer.encode(text).ids
        assert out["input_ids"][0, : len(expected)].tolist() == expected
        assert max(seen) < 40_000, seen
    assert tokenize.prefix_chars == 2 * 128 * 13
