"""A chat request to the generator's inputs: ``input_ids`` and the generation settings.

Takes OpenAI's chat ``{"messages": [{"role": ..., "content": ...}, ...]}`` (the chat
template applied: ``<|role|>\\ncontent<|end|>\\n`` per message, then
``<|assistant|>\\n`` for the model to answer), OpenAI's completions
``{"prompt": "..."}`` or Triton's generate ``{"text_input": "..."}`` (both raw
text, no template: such a text may write the role tags itself). Message
contents are encoded as text only, so a ``<|end|>`` typed by a user is text,
never the tag.

Settings come from ``ctx.parameters`` or the request's top-level keys (Triton's
generate puts them there): ``max_tokens`` (or ``max_completion_tokens``),
``temperature`` (0 to 2; 0 is greedy), ``top_p`` (0 < p <= 1), ``seed`` and
vLLM's ``ignore_eos``;
they reach the runner as one-element tensors.

A prompt longer than ``max_prompt_tokens`` is refused with a 400. One whose characters
certainly make more tokens than that (no token of the vocabulary covers more than
``token_chars`` of them) is refused before any of it is tokenized; the others are
tokenized message by message, and refused as soon as they pass the limit.
"""

import json
import secrets

import numpy as np
import pluggy
from tokenizers import Tokenizer

hookimpl = pluggy.HookimplMarker("plugserve")

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
EOS = "<|end|>"
INT64_MAX = 2**63 - 1


class ChatTemplate:
    def __init__(self, path: str, max_tokens: int, max_tokens_limit: int, max_prompt_tokens: int):
        self.raw = Tokenizer.from_file(path)  # role tags in the text are tags
        self.text = Tokenizer.from_file(path)
        self.text.encode_special_tokens = True  # in message contents they are text
        self.tags = {role: self._special(f"<|{role}|>") for role in set(ROLES.values())}
        self.eos = self._special(EOS)
        self.max_tokens = max_tokens
        self.max_tokens_limit = max_tokens_limit
        self.max_prompt_tokens = max_prompt_tokens
        self.token_chars = token_chars(self.raw)
        """The most characters one token covers; ``None``: no such bound holds."""

    def _special(self, token: str) -> int:
        found = self.raw.token_to_id(token)
        if found is None:
            raise ValueError(f"the tokenizer has no {token} token")
        return found

    def process(self, data, ctx):
        if not isinstance(data, dict):
            raise ctx.InvalidInput(
                'expects a JSON object with "messages", "prompt" or "text_input"'
            )
        ids = self._prompt(data, ctx)
        if not ids:
            raise ctx.InvalidInput("the prompt is empty")
        if len(ids) > self.max_prompt_tokens:
            raise ctx.InvalidInput(
                f"the prompt is {len(ids)} tokens; at most {self.max_prompt_tokens} are allowed"
            )
        settings = {**{k: v for k, v in data.items() if k in SETTINGS}, **ctx.parameters}
        max_tokens = self._max_tokens(settings, ctx)
        ctx.usage["prompt_tokens"] = len(ids)
        ctx.usage["max_tokens"] = ctx.state["max_tokens"] = max_tokens
        return {
            "input_ids": np.array([ids], dtype=np.int64),
            "max_tokens": np.array([max_tokens], dtype=np.int32),
            "temperature": np.array(
                [_number(settings, "temperature", 1.0, 0.0, 2.0, ctx)], np.float32
            ),
            "top_p": np.array([_top_p(settings, ctx)], dtype=np.float32),
            "seed": np.array([_seed(settings, ctx)], dtype=np.int64),
            "ignore_eos": np.array([_flag(settings, "ignore_eos", ctx)], dtype=np.bool_),
        }

    def _prompt(self, data, ctx) -> list[int]:
        if "messages" in data:
            return self._chat(data["messages"], ctx)
        for key in ("prompt", "text_input"):
            if key in data:
                text = _text(_value(data[key]), key, ctx)
                self._check_length(len(text), 0, ctx)
                return self.raw.encode(text).ids
        raise ctx.InvalidInput('expects "messages" (chat), "prompt" or "text_input"')

    def _chat(self, messages, ctx) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise ctx.InvalidInput("messages must be a non-empty list of {role, content}")
        least = 2 * len(messages) + 1  # each message's tag and <|end|>, the answer's tag
        if least > self.max_prompt_tokens:
            raise ctx.InvalidInput(
                f"the prompt is at least {least} tokens ({len(messages)} messages); at most "
                f"{self.max_prompt_tokens} are allowed"
            )
        turns = [self._turn(message, i, ctx) for i, message in enumerate(messages)]
        # Each message adds its role tag and <|end|>; the answer's tag follows the last.
        self._check_length(sum(len(content) for _, content in turns), 2 * len(turns) + 1, ctx)
        ids: list[int] = []
        newline = self.text.encode("\n").ids
        for role, content in turns:
            ids += [self.tags[role], *self.text.encode("\n" + content).ids, self.eos, *newline]
            if len(ids) > self.max_prompt_tokens:  # the rest of the messages cannot help
                raise ctx.InvalidInput(
                    f"the prompt is over {self.max_prompt_tokens} tokens (more than "
                    f"{len(ids)} before the end of its messages); at most "
                    f"{self.max_prompt_tokens} are allowed"
                )
        return [*ids, self.tags["assistant"], *newline]

    def _turn(self, message, i: int, ctx) -> tuple[str, str]:
        """A message's role (as its tag names it) and content, checked."""
        if not isinstance(message, dict):
            raise ctx.InvalidInput(f"messages[{i}] must be an object with role and content")
        given = message.get("role")
        role = ROLES.get(given) if isinstance(given, str) else None
        if role is None:
            raise ctx.InvalidInput(
                f"messages[{i}].role must be system, user or assistant; got {given!r}"
            )
        return role, _content(message.get("content"), i, ctx)

    def _check_length(self, chars: int, tags: int, ctx) -> None:
        """Refuse, before tokenizing, a prompt of ``chars`` characters (and ``tags`` tokens
        besides) that certainly makes more than ``max_prompt_tokens`` tokens."""
        per = self.token_chars
        if per is None:
            return
        least = -(-chars // per) + tags
        if least > self.max_prompt_tokens:
            raise ctx.InvalidInput(
                f"the prompt is at least {least} tokens ({chars} characters, and no token "
                f"covers more than {per}); at most {self.max_prompt_tokens} are allowed"
            )

    def _max_tokens(self, settings, ctx) -> int:
        key = "max_completion_tokens" if "max_completion_tokens" in settings else "max_tokens"
        value = _value(settings.get(key, self.max_tokens))
        if value is None:
            return self.max_tokens
        if not _is_int(value) or not 1 <= value <= self.max_tokens_limit:
            raise ctx.InvalidInput(
                f"{key} must be an integer from 1 to {self.max_tokens_limit}; got {value!r}"
            )
        return int(value)


SETTINGS = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "ignore_eos"}


def _flag(settings, key: str, ctx) -> bool:
    value = _value(settings.get(key, False))
    if not isinstance(value, bool):
        raise ctx.InvalidInput(f"{key} must be true or false; got {value!r}")
    return value


def _value(value):
    """A setting as a Python value: one-element arrays and lists (v2 tensors) unwrapped."""
    if isinstance(value, np.ndarray):
        value = value.tolist() if value.size != 1 else value.reshape(()).item()
    if isinstance(value, list) and len(value) == 1 and not isinstance(value[0], dict):
        value = value[0]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return value
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(value, key: str, ctx) -> str:
    if not isinstance(value, str):
        raise ctx.InvalidInput(f"{key} must be a UTF-8 string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ctx.InvalidInput(f"{key} is not valid UTF-8 (a lone surrogate)") from None
    return value


def _content(content, i: int, ctx) -> str:
    """A message's content: a string, or OpenAI's list of ``{"type": "text", "text": ...}``."""
    key = f"messages[{i}].content"
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ctx.InvalidInput(
                    f'{key}[{j}] must be a text part: {{"type": "text", "text": ...}}'
                )
            parts.append(_text(part.get("text"), f"{key}[{j}].text", ctx))
        return "".join(parts)
    return _text(content, key, ctx)


def _number(settings, key: str, default: float, low: float, high: float, ctx) -> float:
    value = _value(settings.get(key, default))
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ctx.InvalidInput(f"{key} must be a number from {low:g} to {high:g}; got {value!r}")
    return float(value)


def _top_p(settings, ctx) -> float:
    value = _number(settings, "top_p", 1.0, 0.0, 1.0, ctx)
    if value <= 0.0:
        raise ctx.InvalidInput(f"top_p must be above 0 and at most 1; got {value!r}")
    return value


def _seed(settings, ctx) -> int:
    value = _value(settings.get("seed"))
    if value is None:
        return secrets.randbits(63)
    if not _is_int(value) or not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ctx.InvalidInput(f"seed must be a 64-bit integer; got {value!r}")
    return int(value)


SAFE_NORMALIZERS = {"Lowercase", "NFD", "NFKD"}
"""Normalizers that never make a text shorter."""
SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Punctuation", "Digits", "UnicodeScripts"}
"""Pre-tokenizers that keep every character: the tokens cover all of the text."""


def token_chars(tokenizer: Tokenizer) -> int | None:
    """The most characters of a text one token can cover: its longest string in the
    vocabulary, added tokens included (a byte-level token covers at most as many
    characters as it has bytes). ``None`` when no such bound holds: a model that maps a
    run of unknown characters to one token, a normalizer or a pre-tokenizer that can
    drop characters, an added token that strips the spaces beside it."""
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") and model.get("fuse_unk")):
        return None
    if not _all_of(spec.get("normalizer"), SAFE_NORMALIZERS, "normalizers"):
        return None
    if not _all_of(spec.get("pre_tokenizer"), SAFE_PRE_TOKENIZERS, "pretokenizers"):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return None  # such a token takes in the spaces beside it, however many
    return max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1) or 1


def _all_of(step, safe: set[str], key: str) -> bool:
    """Whether a normalizer or pre-tokenizer (``None``, one, or a ``Sequence``) is of
    ``safe`` kinds only."""
    if step is None:
        return True
    if step.get("type") == "Sequence":
        return all(_all_of(part, safe, key) for part in step.get(key, []))
    return step.get("type") in safe


@hookimpl
def plugserve_create_component(plugin, config):
    return ChatTemplate(
        str(plugin.resolve(config["tokenizer"])),
        max_tokens=int(config.get("max_tokens", 64)),
        max_tokens_limit=int(config.get("max_tokens_limit", 512)),
        max_prompt_tokens=int(config.get("max_prompt_tokens", 1024)),
    )
