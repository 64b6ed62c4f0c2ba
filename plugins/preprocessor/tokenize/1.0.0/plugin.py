"""Texts to ``input_ids`` and ``attention_mask`` for an encoder, with the ``tokenizers`` package.

Takes OpenAI's embeddings input, ``{"input": "text"}``, ``{"input": ["a", "b"]}`` or
token-id lists (``{"input": [[101, 7592], [2023]]}``, used as given), or a v2
request's ``text`` tensor (BYTES, one text per element). Texts longer than
``max_length`` tokens are cut; the batch is padded to its longest text rounded
up to a multiple of 16, so requests of similar length batch together. The mask
goes to ``ctx.state["attention_mask"]`` for the pooling postprocessor.
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
        # One text (the usual request) skips encode_batch's thread pool hand-off.
        batch = (
            [self.tokenizer.encode(texts[0])]
            if len(texts) == 1
            else self.tokenizer.encode_batch(texts)
        )
        encoded = iter(batch)
        cut = self.max_length
        return [
            next(encoded).ids if isinstance(item, str) else [int(v) for v in item[:cut]]
            for item in items
        ]

    def metadata(self):
        return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}]}


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
