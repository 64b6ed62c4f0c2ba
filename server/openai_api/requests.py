"""OpenAI request bodies, declared (:class:`ChatBody`, :class:`CompletionsBody`,
:class:`EmbeddingsBody`, which the OpenAPI document publishes), checked, and made into what
the chain gets: its data and its parameters.

The chain of an ``openai`` route reads:

- embeddings: ``{"input": [text, ...]}`` (or ``[[token id, ...], ...]``); its
  last stage returns the embeddings, ``[N, D]`` (``{"embeddings": array}``).
- chat: ``{"messages": [{"role": ..., "content": text}, ...]}``; completions:
  ``{"prompt": text}``. Each response of the stream carries ``text_output``,
  the new text. The generation settings (``max_tokens``, ``temperature``,
  ``top_p``, ``seed``, ``stop``, ``presence_penalty``, ``frequency_penalty``,
  and vLLM's ``ignore_eos``) are the request's parameters (``ctx.parameters``).

Anything a route cannot honour is refused with a 400 that names the field,
never ignored: tools, logprobs, a JSON response format, token prompts. Fields OpenAI
defines that change nothing here (``user``, ``metadata``, ...) are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.json_schema import models_json_schema

from plugserve.registry import checks
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


# -- the bodies, declared -------------------------------------------------------------------

Token = Annotated[int, Field(ge=0, lt=2**31)]
Stop = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Seed = Annotated[int, Field(ge=-INT64_SPAN // 2, le=INT64_SPAN // 2 - 1)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, defer_build=True)

    model: Annotated[str, Field(min_length=1)]
    """The route that answers."""


class EmbeddingsBody(_Body):
    """``POST /v1/embeddings``."""

    input: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
        | Annotated[list[Token], Field(min_length=1)]
        | Annotated[list[Annotated[list[Token], Field(min_length=1)]], Field(min_length=1)]
    ) = Field(union_mode="left_to_right")
    """A text, texts, one input's token ids, or several inputs' token ids."""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    """Keep the first ``dimensions`` of each embedding (renormalized)."""

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> Any:
        if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
            return value  # the tokens of one input
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items:
            raise ValueError("'input' must be a text, a list of texts or of token lists")
        for i, item in enumerate(items):
            tokens = isinstance(item, list) and item and all(_token(t) for t in item)
            if not ((isinstance(item, str) and item) or tokens):
                raise ValueError(f"input[{i}] must be a non-empty text or token list")
        return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, defer_build=True)

    include_usage: bool = False
    """A last chunk with the request's token counts."""


class _GenerationBody(_Body):
    """What chat and completions share: how text is generated."""

    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    ignore_eos: bool | None = None
    """vLLM's extension: generate ``max_tokens``, always."""
    seed: Seed | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOPS)] | None = Field(
        default=None, union_mode="left_to_right"
    )
    """A text, or up to four, that end the generation where they appear (not sent)."""
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    """Completions per prompt; with several prompts, at most 16 in all."""
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stream_options")
    @classmethod
    def _streamed(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise ValueError("'stream_options' is for 'stream': true only")
        return value


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, defer_build=True)

    type: Literal["text"]
    """Text only: a JSON response format is not supported."""


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, defer_build=True)

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, defer_build=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    """A text or text parts; only an assistant's may be absent."""
    name: Any = None


class ChatBody(_GenerationBody):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    """``max_tokens``'s newer name: it wins over ``max_tokens``."""
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    """Not supported: refused when true."""
    top_logprobs: int | None = None
    """Not supported: refused unless 0."""
    tools: Any = None
    """Not supported (nor ``functions``, ``tool_choice``, ``function_call``, ``logit_bias``,
    ``audio``): refused unless empty."""
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    logit_bias: Any = None
    audio: Any = None

    @field_validator(*UNSUPPORTED, mode="before")
    @classmethod
    def _unsupported(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        if value not in (None, [], {}):
            raise ValueError(
                f"'{info.field_name}' is not supported: plugserve routes generate text"
            )
        return None

    @field_validator("logprobs", "top_logprobs", mode="before")
    @classmethod
    def _no_logprobs(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        if value:
            raise ValueError(f"'{info.field_name}' is not supported")
        return value

    @field_validator("response_format", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value is not None and (not isinstance(value, dict) or value.get("type") != "text"):
            raise ValueError("'response_format' other than text is not supported")
        return value

    @field_validator("messages", mode="before")
    @classmethod
    def _roles(cls, value: Any) -> Any:
        for i, message in enumerate(value if isinstance(value, list) else []):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise ValueError(
                    f"messages[{i}] must be an object with a 'role' of {', '.join(ROLES)}"
                )
            if message.get("content") is None and message["role"] != "assistant":
                raise ValueError(f"messages[{i}]: 'content' must be a text or a list of text parts")
        return value


class CompletionsBody(_GenerationBody):
    """``POST /v1/completions``."""

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] = Field(
        union_mode="left_to_right"
    )
    """A text, or up to 16 texts (token prompts are not supported)."""
    echo: bool = False
    """The prompt before each completion."""
    suffix: Any = None
    """Not supported: refused unless empty."""
    logprobs: Any = None
    """Not supported: refused unless null."""
    best_of: Any = None
    """Not supported: refused unless 1."""

    @field_validator("suffix", "logprobs", "best_of", mode="before")
    @classmethod
    def _unsupported(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        allowed = {"suffix": (None, ""), "logprobs": (None,), "best_of": (None, 1)}
        if value not in allowed[info.field_name or ""] or isinstance(value, bool):
            raise ValueError(f"'{info.field_name}' is not supported")
        return value

    @field_validator("prompt", mode="before")
    @classmethod
    def _texts(cls, value: Any) -> Any:
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not texts or not all(isinstance(p, str) for p in texts):
            raise ValueError("'prompt' must be a text or a list of texts (not tokens)")
        return value


def openapi_schemas() -> dict[str, Any]:
    """The bodies' JSON Schemas, as OpenAPI components (``#/components/schemas/...``)."""
    checks.with_docstrings(EmbeddingsBody, ChatBody, CompletionsBody)
    _, found = models_json_schema(
        [(EmbeddingsBody, "validation"), (ChatBody, "validation"), (CompletionsBody, "validation")],
        ref_template="#/components/schemas/{model}",
    )
    schemas: dict[str, Any] = found["$defs"]
    return schemas


B = TypeVar("B", bound=BaseModel)


def _validated(model: type[B], body: Any) -> B:
    """``body`` as ``model``, or :class:`Refused` naming the first field at fault."""
    if not isinstance(body, dict):
        raise Refused("the body must be a JSON object")
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        loc = exc.errors(include_url=False)[0]["loc"]
        param = str(loc[0]) if loc else None
        raise Refused(checks.schema_problems(exc, model)[0], param) from None


# -- what the chain gets --------------------------------------------------------------------


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


def model_of(body: Any) -> str:
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model:
        raise Refused("'model' must be the name of a route", "model")
    return model


def embeddings(body: Any) -> Embeddings:
    model_of(body)
    asked = _validated(EmbeddingsBody, body)
    raw = asked.input
    one = isinstance(raw, str) or all(isinstance(t, int) for t in raw)
    items: list[Any] = [raw] if one else list(raw)
    return Embeddings(asked.model, items, asked.encoding_format == "base64", asked.dimensions)


def chat(body: Any) -> Generation:
    model_of(body)
    asked = _validated(ChatBody, body)
    messages = [_message(m) for m in asked.messages]
    tokens = asked.max_completion_tokens or asked.max_tokens
    return _generation(asked, [{"messages": messages}], tokens)


def completions(body: Any) -> Generation:
    model_of(body)
    asked = _validated(CompletionsBody, body)
    prompts = [asked.prompt] if isinstance(asked.prompt, str) else asked.prompt
    generation = _generation(asked, [{"prompt": p} for p in prompts], asked.max_tokens)
    generation.echo = asked.echo
    return generation


def _generation(
    asked: _GenerationBody, inputs: list[dict[str, Any]], max_tokens: int | None
) -> Generation:
    parameters: dict[str, Any] = {}
    if max_tokens is not None:
        parameters["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        value = getattr(asked, name)
        if value is not None:
            parameters[name] = float(value)
    if asked.ignore_eos is not None:
        parameters["ignore_eos"] = asked.ignore_eos
    if asked.seed is not None:
        parameters["seed"] = asked.seed
    stop = (asked.stop,) if isinstance(asked.stop, str) else tuple(asked.stop or ())
    if stop:
        parameters["stop"] = list(stop)
    choices = asked.n or 1
    if choices * len(inputs) > MAX_CHOICES:
        raise Refused(f"at most {MAX_CHOICES} choices a request (prompts x n)", "n")
    return Generation(
        asked.model,
        inputs,
        parameters,
        choices=choices,
        stream=asked.stream,
        include_usage=asked.stream_options is not None and asked.stream_options.include_usage,
        stop=stop,
        max_tokens=max_tokens,
        seed=asked.seed,
    )


def _message(message: Message) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):  # content parts: text only
        content = "".join(part.text for part in content)
    checked: dict[str, Any] = {"role": message.role, "content": content or ""}
    if isinstance(message.name, str):
        checked["name"] = message.name
    return checked


def _token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31
