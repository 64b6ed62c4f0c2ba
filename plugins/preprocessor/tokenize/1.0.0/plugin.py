"""Texts to ``input_ids`` and ``attention_mask`` for an encoder, with the ``tokenizers`` package.

Takes OpenAI's embeddings input, ``{"input": "text"}``, ``{"input": ["a", "b"]}`` or
token-id lists (``{"input": [[101, 7592], [2023]]}``, used as given), or a v2
request's ``text`` tensor (BYTES, one text per element). Texts longer than
``max_length`` tokens are cut; the batch is padded to its longest text rounded
up to a multiple of 16, so requests of similar length batch together. The mask
goes to ``ctx.state["attention_mask"]`` for the pooling postprocessor.

A long text is not tokenized whole to keep its first ``max_length`` tokens: a prefix of
twice as many characters as they can cover (``max_length`` times the longest token in the
vocabulary) is, and kept if its tokens reach past ``max_length`` and the last one kept ends
in its first half; otherwise a prefix twice as long is tried, up to the whole text.
"""

import numpy as np
import pluggy
from tokenizers import Tokenizer

hookimpl = pluggy.HookimplMarker("plugserve")

PAD_TO = 16


class Tokenize:
    def __init__(
        self,
        tokenizer: Tokenizer,
        max_length: int,
        max_inputs: int,
        pad_token: str,
        token_type_ids: bool = False,
    ):
        self.tokenizer = tokenizer
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length)
        self.max_length = max_length
        self.max_inputs = max_inputs
        self.vocab = tokenizer.get_vocab_size()
        longest = max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)
        self.prefix_chars = 2 * max_length * max(longest, 1)
        """A text longer than this is tokenized by prefixes (``_encode_long``)."""
        pad_id = tokenizer.token_to_id(pad_token)
        self.pad_id = 0 if pad_id is None else pad_id
        self.token_type_ids = token_type_ids

    def process(self, data, ctx):
        rows = self._rows(self._inputs(data, ctx), ctx)
        width = min(-(-max(map(len, rows)) // PAD_TO) * PAD_TO, self.max_length)
        width = max(width, max(map(len, rows)))
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        ctx.state["attention_mask"] = mask
        ctx.usage["prompt_tokens"] = int(mask.sum())
        if self.token_type_ids:  # BERT-style encoders exported by optimum take them
            return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        return {"input_ids": ids, "attention_mask": mask}

    def _inputs(self, data, ctx) -> list:
        """The request's texts (str) or token-id lists, checked for shape and count."""
        if isinstance(data, dict) and "input" in data:
            items = data["input"]
            if isinstance(items, str):
                items = [items]
            elif isinstance(items, list) and items and all(_is_int(v) for v in items):
                items = [items]  # one text as token ids
        elif isinstance(data, dict) and "text" in data:
            items = _texts(data["text"], ctx)
        else:
            raise ctx.InvalidInput(
                'expects {"input": text or [texts] or [[token ids]]} or a v2 "text" tensor (BYTES)'
            )
        if not isinstance(items, list) or not items:
            raise ctx.InvalidInput("input must be a text, a non-empty list of texts or token lists")
        if len(items) > self.max_inputs:
            limit = self.max_inputs
            raise ctx.InvalidInput(f"at most {limit} inputs per request; got {len(items)}")
        for i, item in enumerate(items):
            if isinstance(item, str):
                if not item:
                    raise ctx.InvalidInput(f"input {i} is an empty text")
                if not _is_utf8(item):
                    raise ctx.InvalidInput(f"input {i} is not valid UTF-8 (a lone surrogate)")
            elif isinstance(item, list) and all(_is_int(v) for v in item):
                if not item:
                    raise ctx.InvalidInput(f"input {i} is an empty token list")
                if not all(0 <= v < self.vocab for v in item):
                    raise ctx.InvalidInput(f"input {i}: token ids must lie in [0, {self.vocab})")
            else:
                raise ctx.InvalidInput(f"input {i} is neither a text nor a list of token ids")
        return items

    def _rows(self, items: list, ctx) -> list[list[int]]:
        texts = [item for item in items if isinstance(item, str)]
        prefix = self.prefix_chars
        cut = [text[:prefix] for text in texts]
        # One text (the usual request) skips encode_batch's thread pool hand-off.
        batch = (
            [self.tokenizer.encode(cut[0])] if len(cut) == 1 else self.tokenizer.encode_batch(cut)
        )
        encoded = iter(
            done if len(text) <= prefix or _holds(done, prefix) else self._encode_long(text)
            for text, done in zip(texts, batch, strict=True)
        )
        cut = self.max_length
        return [
            next(encoded).ids if isinstance(item, str) else [int(v) for v in item[:cut]]
            for item in items
        ]

    def _encode_long(self, text: str):
        """The encoding of a text longer than ``prefix_chars``, from the shortest of the
        prefixes ``prefix_chars * 2**k`` whose tokens show the cut cannot change the kept
        ones (a normalizer that drops characters makes one hold fewer tokens)."""
        cut = 2 * self.prefix_chars  # the first prefix did not hold them
        while cut < len(text):
            encoded = self.tokenizer.encode(text[:cut])
            if _holds(encoded, cut):
                return encoded
            cut *= 2
        return self.tokenizer.encode(text)

    def metadata(self):
        return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}]}


def _holds(encoded, cut: int) -> bool:
    """Whether the encoding of a text's first ``cut`` characters is that of the whole text:
    it was truncated (more tokens followed), and the last token kept ends in the prefix's
    first half, far from where the text was cut."""
    return bool(encoded.overflowing) and 2 * max(end for _, end in encoded.offsets) <= cut


def _is_int(value) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _texts(tensor, ctx) -> list[str]:
    """A v2 BYTES tensor (an object array of bytes or str) as a list of texts."""
    texts = []
    for i, item in enumerate(np.asarray(tensor, dtype=object).ravel()):
        if isinstance(item, bytes | bytearray | memoryview):
            try:
                item = bytes(item).decode("utf-8")
            except UnicodeDecodeError:
                raise ctx.InvalidInput(f"text {i} is not valid UTF-8") from None
        if not isinstance(item, str):
            raise ctx.InvalidInput(f"text {i} is not a string")
        texts.append(item)
    return texts


@hookimpl
def plugserve_create_component(plugin, config):
    return Tokenize(
        Tokenizer.from_file(str(plugin.resolve(config["tokenizer"]))),
        max_length=int(config.get("max_length", 128)),
        max_inputs=int(config.get("max_inputs", 256)),
        pad_token=config.get("pad_token", "[PAD]"),
        token_type_ids=bool(config.get("token_type_ids", False)),
    )
