"""``/v1/models``, ``/v1/embeddings``, ``/v1/chat/completions`` and ``/v1/completions``.

A route is served here when its runner's manifest says ``[route] openai =
"embeddings" | "chat" | "completions"`` (or a list), with ``model`` = the
route's name. Requests go through the same path as every other (admission,
rate limits, drain, deadlines with ``X-Request-Timeout``, metrics under
``protocol="openai"``); ``stream: true`` answers Server-Sent Events ending in
``data: [DONE]``. The server keeps ``max_tokens`` (it counts the runner's
responses, one a token) and ``stop`` sequences (held back while they may be
starting, cut when they appear) whatever the chain does with them: either one
closes the stream, which stops the runner before its next step.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import orjson
from aiohttp import web

from plugserve.registry.errors import NotFound, PluginError, PlugserveError
from plugserve.registry.execution.chain import Chain
from plugserve.registry.execution.together import together
from plugserve.registry.types import RequestContext
from plugserve.server.dataplane.plane import DATA_PLANE, Inference, Served
from plugserve.server.http import sse
from plugserve.server.http.bodies import BODIES
from plugserve.server.http.connections import cancel_on_hangup
from plugserve.server.http.jsonio import json_value, parse_json
from plugserve.server.http.middleware import error_shapes
from plugserve.server.openai_api import errors, requests
from plugserve.server.runtime.logs import REQUEST_ID
from plugserve.server.state import REGISTRY

PROTOCOL = "openai"
T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


def _json(payload: Any) -> web.Response:
    body = orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
    return web.Response(body=body, content_type="application/json")


# -- models ---------------------------------------------------------------------------------


def _kinds(chain: Chain) -> tuple[str, ...]:
    return chain.runner.manifest.route.openai


def _card(chain: Chain) -> dict[str, Any]:
    return {
        "id": chain.route,
        "object": "model",
        "created": int(chain.runner.loaded_at),
        "owned_by": "plugserve",
        "version": chain.runner_version,
        "endpoints": list(_kinds(chain)),
    }


def _served(request: web.Request) -> list[Chain]:
    table = request.app[REGISTRY].routes
    chains = []
    for name in sorted(table.entries):
        with contextlib.suppress(PlugserveError):  # not ready: not listed
            chain = table.resolve(name)
            if _kinds(chain):
                chains.append(chain)
    return chains


async def list_models(request: web.Request) -> web.Response:
    return _json({"object": "list", "data": [_card(c) for c in _served(request)]})


async def get_model(request: web.Request) -> web.Response:
    model = request.match_info["model"]
    for chain in _served(request):
        if chain.route == model:
            return _json(_card(chain))
    raise NotFound(f"The model '{model}' does not exist")


def _check_serves(chain: Chain, kind: str) -> None:
    if kind not in _kinds(chain):
        raise NotFound(f"The model '{chain.route}' does not exist or is not served at /v1/{kind}")


# -- embeddings -----------------------------------------------------------------------------


async def embeddings(request: web.Request) -> web.Response:
    cancel_on_hangup(request)
    asked: requests.Embeddings

    async def read(served: Served) -> Inference:
        nonlocal asked
        asked, size = await _asked(request, requests.embeddings, served)
        return Inference(asked.model, {"input": asked.input}, {}, size)

    async def answer(served: Served) -> web.Response:
        chain = served.chain
        _check_serves(chain, "embeddings")
        vectors = _vectors(chain, await served.result(), len(asked.input))
        if asked.dimensions is not None:
            vectors = _shortened(vectors, asked.dimensions)
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": base64.b64encode(row.astype("<f4").tobytes()).decode()
                if asked.base64
                else row,
            }
            for i, row in enumerate(vectors)
        ]
        tokens = served.ctx.usage.get("prompt_tokens", 0)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return _json({"object": "list", "data": data, "model": chain.route, "usage": usage})

    return await request.app[DATA_PLANE].infer(request, PROTOCOL, read, answer)


async def _asked(request: web.Request, check: Callable[[Any], T], served: Served) -> tuple[T, int]:
    """The request's body, read and checked by ``check`` (on the pool with the parse, for a
    large body: a million messages take seconds), and its size. The route it names counts
    the request from the moment it is read, refused or not."""

    def parsed(raw: bytes) -> T:
        body = parse_json(raw)
        model = body.get("model") if isinstance(body, dict) else None
        if isinstance(model, str):
            served.route = model
        return check(body)

    bodies = request.app[BODIES]
    body = await bodies.read(request, json=True)
    return await bodies.parse(request, body, parsed), len(body)


def _vectors(chain: Chain, result: Any, count: int) -> np.ndarray:
    """The chain's embeddings as float32 ``[count, D]``; a 500 naming the last stage if not."""
    if isinstance(result, dict):
        result = result.get("embeddings", next(iter(result.values()), None))
    try:
        vectors = np.ascontiguousarray(np.asarray(result, dtype=np.float32))
    except (TypeError, ValueError) as exc:
        raise PluginError(chain.stages[-1].label, exc) from None
    if vectors.ndim != 2 or vectors.shape[0] != count:
        problem = ValueError(f"embeddings of shape {vectors.shape} for {count} inputs")
        raise PluginError(chain.stages[-1].label, problem)
    return vectors


def _shortened(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """The first ``dimensions`` of each vector, normalized again (as OpenAI's models do)."""
    if dimensions > vectors.shape[1]:
        raise requests.Refused(
            f"'dimensions' must be at most {vectors.shape[1]} for this model", "dimensions"
        )
    cut = vectors[:, :dimensions]
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return np.ascontiguousarray(cut / np.where(norms == 0, 1, norms))


# -- text generation ----------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completions")


@dataclass
class Choice:
    """One completion being made: its index, its chain data and its own ``ctx``."""

    index: int
    data: dict[str, Any]
    ctx: RequestContext
    prompt: str = ""
    finish: str | None = None


class Stops:
    """``stop`` sequences on a stream of text: text that may begin one is held back."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """What may be sent of ``text`` now, and whether a stop sequence ended the text."""
        if not self.stops:
            return text, False
        seen = self.held + text
        found = [at for at in (seen.find(s) for s in self.stops) if at >= 0]
        if found:
            self.held = ""
            return seen[: min(found)], True
        keep = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(seen)), keep, -1):
                if seen.endswith(stop[:size]):
                    keep = size
                    break
        self.held = seen[len(seen) - keep :]
        return seen[: len(seen) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


async def _pieces(
    served: Served, choice: Choice, asked: requests.Generation
) -> AsyncGenerator[str, None]:
    """The text of one choice, piece by piece; ``choice.finish`` is set when it ends."""
    stops = Stops(asked.stop)
    usage = choice.ctx.usage
    # Bytes are decoded across responses: a character's bytes may come in two tokens.
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    responses = served.responses(choice.data, choice.ctx)
    async with contextlib.aclosing(responses):
        async for response in responses:
            text, stopped = stops.feed(_text(served.chain, response, decoder))
            if text:
                yield text
            if stopped:
                choice.finish = "stop"
                return
            if (
                asked.max_tokens is not None
                and usage.get("completion_tokens", 0) >= asked.max_tokens
            ):
                break
    text, stopped = stops.feed(decoder.decode(b"", final=True))
    if tail := text + ("" if stopped else stops.flush()):
        yield tail
    if stopped:
        choice.finish = "stop"
        return
    limit = asked.max_tokens or usage.get("max_tokens")
    made = usage.get("completion_tokens", 0)
    choice.finish = "length" if limit is not None and made >= limit else "stop"


def _text(chain: Chain, response: Any, decoder: codecs.IncrementalDecoder) -> str:
    if isinstance(response, dict):
        response = response.get("text_output", response.get("text"))
    if isinstance(response, np.ndarray) and response.size == 1:
        response = response.reshape(()).item()
    if isinstance(response, bytes):
        return decoder.decode(response)
    value = json_value(response)
    if not isinstance(value, str):
        problem = TypeError(f"a response without 'text_output' text ({type(value).__name__})")
        raise PluginError(chain.stages[-1].label, problem)
    return value


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    cancel_on_hangup(request)
    check = requests.chat if kind == "chat" else requests.completions
    asked: requests.Generation

    async def read(served: Served) -> Inference:
        nonlocal asked
        asked, size = await _asked(request, check, served)
        # A stream's deadline is kept by sse.send, which can still tell the client.
        return Inference(asked.model, None, asked.parameters, size, streams=asked.stream)

    async def answer(served: Served) -> web.StreamResponse:
        chain = served.chain
        _check_serves(chain, kind)
        choices: list[Choice] = []
        for data in asked.inputs:
            for _ in range(asked.choices):
                parameters = dict(asked.parameters)
                if asked.seed is not None and len(choices):  # n > 1: a seed of its own each
                    parameters["seed"] = asked.choice_seed(len(choices))
                ctx = served.context(parameters)
                choices.append(Choice(len(choices), data, ctx, data.get("prompt", "")))
        head = {
            "id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{REQUEST_ID.get()}",
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": asked.model,
            "system_fingerprint": chain.variant,
        }
        if not asked.stream:
            # The first choice to fail stops the others; the request ends with the ranked error.
            texts = await together([_whole(served, c, asked) for c in choices])
            made = [
                _choice(kind, c, text, asked.echo) for c, text in zip(choices, texts, strict=True)
            ]
            return _json({**head, "choices": made, "usage": _usage(choices, asked)})
        chunks = _chunks(served, choices, asked, kind, head)
        async with contextlib.aclosing(chunks):
            return await sse.send(request, served, chunks, sse.event, _error_event, DONE)

    return await request.app[DATA_PLANE].infer(request, PROTOCOL, read, answer)


async def _whole(served: Served, choice: Choice, asked: requests.Generation) -> str:
    async with contextlib.aclosing(_pieces(served, choice, asked)) as pieces:
        return "".join([piece async for piece in pieces])


def _choice(kind: str, choice: Choice, text: str, echo: bool) -> dict[str, Any]:
    if kind == "chat":
        message = {"role": "assistant", "content": text, "refusal": None}
        return {
            "index": choice.index,
            "message": message,
            "logprobs": None,
            "finish_reason": choice.finish,
        }
    text = choice.prompt + text if echo else text
    return {"index": choice.index, "text": text, "logprobs": None, "finish_reason": choice.finish}


def _usage(choices: list[Choice], asked: requests.Generation) -> dict[str, int]:
    """Tokens of each prompt once (``n`` choices share it), and of every completion."""
    prompts = sum(c.ctx.usage.get("prompt_tokens", 0) for c in choices[:: asked.choices])
    made = sum(c.ctx.usage.get("completion_tokens", 0) for c in choices)
    return {"prompt_tokens": prompts, "completion_tokens": made, "total_tokens": prompts + made}


async def _chunks(
    served: Served,
    choices: list[Choice],
    asked: requests.Generation,
    kind: str,
    head: dict[str, Any],
) -> AsyncGenerator[dict[str, Any], None]:
    """The stream's chunks: every choice's pieces as they come, its end, then the usage."""
    head = {**head, "object": "chat.completion.chunk" if kind == "chat" else "text_completion"}
    extra = {"usage": None} if asked.include_usage else {}

    def chunk(choice: Choice, text: str | None, finish: str | None) -> dict[str, Any]:
        if kind == "chat":
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if text == "" and finish is None:
                delta["role"] = "assistant"
            part = {"index": choice.index, "delta": delta, "logprobs": None}
        else:
            part = {"index": choice.index, "text": text or "", "logprobs": None}
        return {**head, "choices": [{**part, "finish_reason": finish}], **extra}

    def piece(choice: Choice, text: str | None) -> dict[str, Any]:
        return chunk(choice, text, None) if text is not None else chunk(choice, None, choice.finish)

    async with contextlib.aclosing(_interleaved(served, choices, asked)) as pieces:
        # What fails before the first piece (a preprocessor's 400, a full queue's 429) is
        # an ordinary error answer: nothing is sent until the first piece is made.
        first = await anext(pieces, None)
        for choice in choices:  # chat: the role first; completions: the prompt, if echoed
            if kind == "chat" or asked.echo:
                yield chunk(choice, "" if kind == "chat" else choice.prompt, None)
        if first is not None:
            yield piece(*first)
        async for choice, text in pieces:
            yield piece(choice, text)
    if asked.include_usage:
        yield {**head, "choices": [], "usage": _usage(choices, asked)}


async def _interleaved(
    served: Served, choices: list[Choice], asked: requests.Generation
) -> AsyncGenerator[tuple[Choice, str | None], None]:
    """Every choice's pieces in the order they come, then ``(choice, None)`` as each ends."""
    if len(choices) == 1:
        (choice,) = choices
        async with contextlib.aclosing(_pieces(served, choice, asked)) as pieces:
            async for text in pieces:
                yield choice, text
        yield choice, None
        return
    # Bounded: a client that reads slowly holds the choices' streams back (READ_AHEAD).
    # After the pieces, the error the choices end with, if one fails (the others stopped).
    queue: asyncio.Queue[tuple[Choice, str | None] | Exception] = asyncio.Queue(len(choices))

    async def pump(choice: Choice) -> None:
        async with contextlib.aclosing(_pieces(served, choice, asked)) as pieces:
            async for text in pieces:
                await queue.put((choice, text))
        await queue.put((choice, None))

    async def pumps() -> None:
        try:
            await together([pump(c) for c in choices])
        except Exception as exc:
            await queue.put(exc)

    task = asyncio.create_task(pumps())
    try:
        for _ in choices:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item[1] is None:
                    break
    finally:
        task.cancel()
        await asyncio.wait([task])


def _error_event(exc: PlugserveError) -> bytes:
    return sse.event(errors.of(exc))


def add_routes(app: web.Application) -> None:
    error_shapes(app).add(errors.PREFIX, errors.of)
    r = app.router
    r.add_get("/v1/models", list_models)
    r.add_get("/v1/models/{model}", get_model)
    r.add_post("/v1/embeddings", embeddings)
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/v1/completions", completions)
