"""OpenAI request bodies, checked, as what the chain gets: its data and its parameters.

The chain of an ``openai`` route reads:

- embeddings: ``{"input": [text, ...]}`` (or ``[[token id, ...], ...]``); its
  last stage returns the embeddings, ``[N, D]`` (``{"embeddings": array}``).
- chat: ``{"messages": [{"role": ..., "content": text}, ...]}``; completions:
  ``{"prompt": text}``. Each response of the stream carries ``text_output``,
  the new text. The generation settings (``max_tokens``, ``temperature``,
  ``top_p``, ``seed``, ``stop``, ``presence_penalty``, ``frequency_penalty``,
  and vLLM's ``ignore_eos``) are the request's parameters (``ctx.parameters``).

Anything a route cannot honour is refused with a 400 that names the field,
never ignored: tools, logprobs, a JSON response format, token prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plugserve.registry.errors import InvalidInput

MAX_CHOICES = 16
INT64_SPAN = 2**64
"""How many seeds there are: a seed is a signed 64-bit integer, -2**63 to 2**63 - 1."""
MAX_STOPS = 4
MAX_STOP_CHARS = 1000
"""Longest ``stop`` sequence: the text that may begin one is held back and searched on every
token (``server/openai_api/routes.py`` Stops), in time that grows with its square."""
MAX_TOKENS_LIMIT = 1_000_000
ROLES = ("system", "developer", "user", "assistant", "tool")
UNSUPPORTED = ("tools", "functions", "tool_choice", "function_call", "logit_bias", "audio")
"""Chat features no plugserve chain can answer for: refused, named."""


class Refused(InvalidInput):
    """A bad OpenAI request: its ``param`` is the field at fault (OpenAI's error shape)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Generation:
    """A chat or completions request: the chain's data per choice, and how to run it."""

    model: str
    inputs: list[dict[str, Any]]
    """The chain's data, one per prompt (chat: one)."""
    parameters: dict[str, Any]
    choices: int = 1
    """``n``: completions per prompt."""
    stream: bool = False
    include_usage: bool = False
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None
    echo: bool = False
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice ``index`` (``n`` > 1, or several prompts): ``seed + index``,
        wrapped into the signed 64-bit range, so that every ``seed`` a client may send
        gives each choice a valid seed of its own (choice 1 of ``2**63 - 1`` is ``-2**63``)."""
        if self.seed is None:
            return None
        return (self.seed + index + INT64_SPAN // 2) % INT64_SPAN - INT64_SPAN // 2


@dataclass
class Embeddings:
    model: str
    input: list[Any]
    base64: bool = False
    dimensions: int | None = None


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise Refused("the body must be a JSON object")
    return body


def model_of(body: Any) -> str:
    model = _object(body).get("model")
    if not isinstance(model, str) or not model:
        raise Refused("'model' must be the name of a route", "model")
    return model


def embeddings(body: Any) -> Embeddings:
    body = _object(body)
    model = model_of(body)
    raw = body.get("input")
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
        items = [raw]  # the tokens of one input
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        raise Refused("'input' must be a text, a list of texts or of token lists", "input")
    for i, item in enumerate(items):
        text = isinstance(item, str) and item != ""
        tokens = isinstance(item, list) and item and all(_token(t) for t in item)
        if not (text or tokens):
            raise Refused(f"input[{i}] must be a non-empty text or token list", "input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise Refused("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None:
        dimensions = _integer(dimensions, "dimensions", 1, 1_000_000)
    return Embeddings(model, items, encoding == "base64", dimensions)


def chat(body: Any) -> Generation:
    body = _object(body)
    model = model_of(body)
    for name in UNSUPPORTED:
        if body.get(name) not in (None, [], {}):
            raise Refused(f"'{name}' is not supported: plugserve routes generate text", name)
    if body.get("logprobs") or body.get("top_logprobs"):
        raise Refused("'logprobs' is not supported", "logprobs")
    response_format = body.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, dict) or response_format.get("type") != "text"
    ):
        raise Refused("'response_format' other than text is not supported", "response_format")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Refused("'messages' must be a non-empty list", "messages")
    checked = [_message(m, i) for i, m in enumerate(messages)]
    tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return _generation(model, body, [{"messages": checked}], tokens)


def completions(body: Any) -> Generation:
    body = _object(body)
    model = model_of(body)
    if body.get("suffix") not in (None, ""):
        raise Refused("'suffix' is not supported", "suffix")
    if body.get("logprobs") is not None or body.get("best_of") not in (None, 1):
        name = "logprobs" if body.get("logprobs") is not None else "best_of"
        raise Refused(f"'{name}' is not supported", name)
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise Refused("'prompt' must be a text or a list of texts (not tokens)", "prompt")
    if len(prompts) > MAX_CHOICES:
        raise Refused(f"at most {MAX_CHOICES} prompts a request", "prompt")
    generation = _generation(model, body, [{"prompt": p} for p in prompts], body.get("max_tokens"))
    generation.echo = _boolean(body.get("echo", False), "echo")
    return generation


def _generation(
    model: str, body: dict[str, Any], inputs: list[dict[str, Any]], max_tokens: Any
) -> Generation:
    parameters: dict[str, Any] = {}
    if max_tokens is not None:
        parameters["max_tokens"] = _integer(max_tokens, "max_tokens", 1, MAX_TOKENS_LIMIT)
    for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        if body.get(name) is not None:
            parameters[name] = _number(body[name], name, low, high)
    if parameters.get("top_p") == 0.0:
        raise Refused("'top_p' must be above 0", "top_p")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            parameters[name] = _number(body[name], name, -2.0, 2.0)
    if body.get("ignore_eos") is not None:  # vLLM's extension: generate max_tokens, always
        parameters["ignore_eos"] = _boolean(body["ignore_eos"], "ignore_eos")
    seed = body.get("seed")
    if seed is not None:
        parameters["seed"] = _integer(seed, "seed", -INT64_SPAN // 2, INT64_SPAN // 2 - 1)
    stop = _stops(body.get("stop"))
    if stop:
        parameters["stop"] = list(stop)
    choices = _integer(body.get("n", 1) if body.get("n") is not None else 1, "n", 1, MAX_CHOICES)
    if choices * len(inputs) > MAX_CHOICES:
        raise Refused(f"at most {MAX_CHOICES} choices a request (prompts x n)", "n")
    stream = _boolean(body.get("stream", False), "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise Refused("'stream_options' is an object, for 'stream': true only", "stream_options")
    include_usage = _boolean((options or {}).get("include_usage", False), "stream_options")
    return Generation(
        model,
        inputs,
        parameters,
        choices=choices,
        stream=stream,
        include_usage=include_usage,
        stop=stop,
        max_tokens=parameters.get("max_tokens"),
        seed=parameters.get("seed"),
    )


def _message(message: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise Refused(f"{where} must be an object with a 'role' of {', '.join(ROLES)}", "messages")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise Refused(f"{where}: only text content parts are supported", "messages")
            if not isinstance(part.get("text"), str):
                raise Refused(f"{where}: a text part needs its 'text'", "messages")
            texts.append(part["text"])
        content = "".join(texts)
    if content is None and message["role"] == "assistant":
        content = ""
    if not isinstance(content, str):
        raise Refused(f"{where}: 'content' must be a text or a list of text parts", "messages")
    checked = {"role": message["role"], "content": content}
    if isinstance(message.get("name"), str):
        checked["name"] = message["name"]
    return checked


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise Refused(f"'stop' must be a text or up to {MAX_STOPS} non-empty texts", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise Refused(f"a 'stop' sequence must be at most {MAX_STOP_CHARS} characters", "stop")
    return tuple(stops)


def _token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def _integer(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise Refused(f"'{name}' must be an integer from {low} to {high}", name)
    return value


def _number(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise Refused(f"'{name}' must be a number from {low:g} to {high:g}", name)
    return float(value)


def _boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise Refused(f"'{name}' must be true or false", name)
    return value
