"""The plugserve hook contract: the one page a plugin author needs.

A plugin implements hooks with a marker of its own; it needs nothing but pluggy::

    import pluggy
    hookimpl = pluggy.HookimplMarker("plugserve")

Every hook is named ``plugserve_*``. Each docstring below follows one template:
what the hook is for, its parameters, what its return value means, and a short
example. ``firstresult`` hooks stop at the first non-``None`` result and are
synchronous; anything a component returns that is awaitable is awaited by the
server, so component methods may be plain or ``async`` functions.

Components are plain objects:

- preprocessor: ``process(data, ctx) -> data``
- runner: ``infer(inputs: dict[str, numpy.ndarray]) -> dict[str, numpy.ndarray]``
  on a batch whose first axis is the batch, and optionally ``metadata()``
  returning ``{"inputs": [...], "outputs": [...]}`` tensor specs
  (``name``, ``datatype``, ``shape``)
- runner: optional ``validate(inputs)``, called once per request with that
  request's own arrays, on the event loop, before it can join a batch: the
  place for checks its ``metadata()`` cannot express. Keep it cheap.
- postprocessor: ``format(data, ctx) -> data``
- any component: optional ``warmup()`` (run before it takes traffic) and
  ``close()`` (run after its last request), and optional ``metadata()``.
  Outside requests plugin code is bounded: import, create, ``warmup()`` and
  ``metadata()`` within ``load_timeout_s``, ``close()`` within
  ``close_timeout_s``; sync ones run on a thread of their own.

Saying "bad input": raise ``InvalidInput``, handed to plugins as
``ctx.InvalidInput`` (in ``process`` and ``format``) and ``plugin.InvalidInput``
(to ``plugserve_create_component`` and backend factories; a runner keeps it),
so no plugin imports plugserve. The client gets a 400 whose message starts
with the plugin's label, and the runner's circuit breaker does not count it:
the breaker counts only the runner's own failures (any other exception, a 500).
A batch that ``infer`` refuses with ``InvalidInput`` is run again one request
at a time, so only the requests at fault get 400; ``validate`` avoids the
rerun. Example::

    class Scale:
        def process(self, data, ctx):
            rows = np.asarray(data["input"], dtype=np.float32)
            if rows.ndim != 2 or rows.shape[1] != 4:
                raise ctx.InvalidInput(f"expected rows of 4 features, got shape {rows.shape}")
            return {"input": rows}

    class Doubler:
        def __init__(self, plugin):
            self.InvalidInput = plugin.InvalidInput

        def validate(self, inputs):
            if (inputs["x"] < 0).any():
                raise self.InvalidInput("x must not be negative")

        def infer(self, inputs):
            return {"y": inputs["x"] * 2}

Calling another route (Triton's BLS): an ``async`` ``process`` or ``format`` may
``await ctx.infer("route", {"x": array})``: that route's chain runs in this process,
batched with its own requests, within this request's deadline, priority and tenant,
and its answer (named tensors) comes back; its errors are the route's (404, 503, 400).

Streaming runners (Triton's decoupled models) answer one request with several
responses, in order. A runner streams in one of two ways:

- ``infer`` is a generator (``def infer(inputs): ... yield {...}``) or an async
  generator: called once per request with that request's own arrays (never
  batched with others); each yielded dict of arrays is one response. A sync
  generator's steps (each ``next()``) run on the runner's threads.
- ``start(inputs) -> state`` and ``step(states) -> list`` (continuous
  batching): ``start`` runs once per request on the runner's thread (the
  prompt's prefill, say) and returns the stream's state, an object of the
  runner's own; ``step`` advances several streams by one step at once and
  returns, per state in the same order, that stream's response (a dict of
  arrays), ``None`` when the stream has ended (``None`` sends nothing), or an
  exception (``InvalidInput``: a 400) that ends that stream alone; raising
  fails every stream of the step (it is never run again: it may have
  advanced some states).
  Streams join and leave between steps: a step takes up to ``max_batch_size``
  of the streams in progress (round robin when more are), so a new stream
  waits one step, not for the others to finish. An optional ``stop(state)``
  is called once when a stream leaves for any reason (ended, cancelled by its
  client, past its deadline, failed): free what it holds there. It is called
  between steps, where ``start`` and ``step`` are, never while a step runs
  (at unload: before ``close()``, perhaps while a last step finishes).

``[runner] max_streams`` (default 64) bounds the streams in progress at once;
more wait, by priority and then arrival, up to ``max_queue_size`` (429 beyond).
A stream runs at most 8 responses ahead of its client; one whose client has taken
none of them for 2 s gives its place to a stream of its priority or a higher one
that waits (503 after what it holds, ``stop(state)`` called), so a client that
does not read never holds the runner.
A stream's deadline covers the whole stream (504 when it passes, sent as the
stream's last event); a client that hangs up stops its stream before the next
step. Generation parameters reach the runner as tensors (a preprocessor turns
``ctx.parameters`` such as ``max_tokens`` or ``temperature`` into inputs), so a
runner sees arrays only. For text generation, one response is one token: the
server counts ``completion_tokens`` as the runner's responses, and a
preprocessor reports ``ctx.usage["prompt_tokens"]`` (and ``ctx.usage["max_tokens"]``
when it caps a completion itself, so that the OpenAI routes can say
``finish_reason: "length"``).

The postprocessors of a streaming route run once per response, in order, with
the same ``ctx`` for the whole stream: ``ctx.state`` keeps what a stage carries
from one response to the next (an incremental detokenizer, say). ``format`` may
return ``None`` to send nothing for that response (half of a UTF-8 character).
Example::

    class Countdown:  # a streaming runner: one response per number
        def infer(self, inputs):
            for n in range(int(inputs["start"][0]), 0, -1):
                yield {"n": np.array([n], dtype=np.int64)}

    class Generator:  # continuous batching: one model call advances every stream
        def start(self, inputs):
            return Stream(inputs["input_ids"][0], int(inputs["max_tokens"][0]))

        def step(self, states):
            live = [s for s in states if not s.done]
            tokens = self.model.next_tokens(live)  # one batched call
            ...  # one {"token_id": ...} per live stream, None for the ended

        def stop(self, state):
            state.release()

Declared inputs are checked: when the first stage of a route declares
``metadata()["inputs"]``, v2 requests must match them (names, ranks, fixed
dimensions, datatypes) or get a 400 before any plugin runs; a runner converts
what reaches it to its declared dtypes only when no value changes (and, as a
first stage, takes another datatype from the client only with ``[runner]
cast_inputs = true``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from collections.abc import Mapping

    from aiohttp import web

    from plugserve.registry.types import BackendFactory, PluginInfo

PROJECT_NAME = "plugserve"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""The marker plugin modules use; ``pluggy.HookimplMarker("plugserve")`` is the same."""


@hookspec(firstresult=True)
def plugserve_create_component(plugin: PluginInfo, config: Mapping[str, Any]) -> Any:
    """Create the component of a plugin package that has a ``module``.

    Required for a module plugin, except a runner whose ``[runner] backend``
    builds it. Called once per load of the version, off the event loop, before
    ``warmup()``.

    :param plugin: describes the plugin: ``name``, ``version``, ``type``,
        ``path`` (its folder) and ``logger`` (structlog, bound to the plugin).
    :param config: the manifest's ``[config]`` table (read-only).
    :return: the component object. Stops at first non-``None`` result.

    Example::

        @hookimpl
        def plugserve_create_component(plugin, config):
            return Scale(mean=config["mean"], scale=config["scale"])
    """


@hookspec
def plugserve_backends() -> Mapping[str, BackendFactory]:
    """Declare runner backends by name.

    A declarative runner (``[runner] backend = "name"``) is built by the
    factory registered under that name, called as
    ``factory(plugin, runner, model_path)`` with the manifest's ``[runner]``
    table and the resolved model file (or ``None``). A factory's
    ``runner_keys`` attribute lists the ``[runner]`` keys it reads beyond
    plugserve's own; any other key fails the load. The built-in
    ``onnxruntime`` backend is registered through this hook too. Installed
    packages add backends through the entry-point group ``plugserve``; a name
    claimed by two providers is an error that lists both.

    :return: a mapping of backend name to factory. All results are merged.

    Example::

        @hookimpl
        def plugserve_backends():
            return {"echo": lambda plugin, runner, model_path: EchoRunner()}
    """
    return {}


@hookspec
def plugserve_startup(app: web.Application) -> None:
    """Called once when the server starts, after the initial load of plugins.

    :param app: the aiohttp application (read its state, do not add routes:
        the router is frozen).
    :return: nothing; a returned awaitable is awaited.

    Bounded by ``load_timeout_s``; a sync implementation runs on a thread of
    its own (make it ``async`` to use the event loop).

    Example::

        @hookimpl
        def plugserve_startup(app):
            print("serving")
    """


@hookspec
def plugserve_shutdown(app: web.Application) -> None:
    """Called once when the server stops, before plugins are closed.

    :param app: the aiohttp application.
    :return: nothing; a returned awaitable is awaited.

    All implementations run at once, within ``close_timeout_s``; a sync one on
    a thread of its own.

    Example::

        @hookimpl
        def plugserve_shutdown(app):
            print("bye")
    """
