"""The objects plugserve hands to plugins: plain, typed, documented.

Plugins never need to import these (duck typing is enough); they exist so that
the contract is written down once, in code, and checked by mypy.

Both carry ``InvalidInput``, the exception a plugin raises to refuse a request's
input (a 400, never counted by the circuit breaker) without importing plugserve:
``raise ctx.InvalidInput("expected 4 features, got 3")`` in a processor,
``raise self.plugin.InvalidInput(...)`` in a runner that kept its ``plugin``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from structlog.typing import FilteringBoundLogger

from plugserve.registry.errors import InvalidInput, PluginLoadError
from plugserve.registry.refs import PluginType


@dataclass(frozen=True)
class PluginInfo:
    """Describes the plugin being created: handed to ``plugserve_create_component``
    and to backend factories.

    ``logger`` is a structlog logger bound to the plugin's type, name and version;
    ``InvalidInput`` is the exception that refuses a request's input with a 400.
    """

    InvalidInput: ClassVar[type[InvalidInput]] = InvalidInput

    name: str
    version: str
    type: PluginType
    path: Path
    logger: FilteringBoundLogger
    model: Path | None = None
    """The file a runner's ``[runner] model`` resolves to (for a module runner to open)."""
    models_dir: Path | None = None

    @property
    def label(self) -> str:
        return f"{self.type}/{self.name}@{self.version}"

    def resolve(self, spec: str) -> Path:
        """A file named the way ``[runner] model`` names one: a path relative to the
        plugin's folder, or ``models:<name>/<version>/<file>`` in the models dir (a
        tokenizer, a vocabulary, a labels file). Raises :class:`PluginLoadError`
        when it does not exist or lies outside the plugins and models dirs."""
        from plugserve.registry.models import resolve_model

        return resolve_model(spec, self.path, self.models_dir or self.path, None)

    def model_metadata(self, spec: str | None = None) -> dict[str, str]:
        """The custom metadata of an ONNX model (its ``metadata_props``: an OCR model's
        character list, labels, a preprocessing recipe): the model ``spec`` names, as
        :meth:`resolve` names a file, else this runner's own ``[runner] model``. Each call
        loads the model once with ONNX Runtime on the CPU: read it when the component is
        created, not per request. Raises :class:`PluginLoadError` when there is no such
        model or it cannot be read."""
        from plugserve.registry.models import onnx_metadata

        if spec is not None:
            return onnx_metadata(self.resolve(spec))
        if self.model is None:
            raise PluginLoadError(
                f"{self.label}: no [runner] model of its own: name the model "
                "(plugin.model_metadata('models:<name>/<version>/<file>'))"
            )
        return onnx_metadata(self.model)


@dataclass
class RequestContext:
    """The ``ctx`` of ``process(data, ctx)`` and ``format(data, ctx)``.

    ``parameters`` are the request's parameters (v2 ``parameters``, or the query
    string of a ``/predict`` call); ``protocol`` is ``"v2"`` or ``"predict"``;
    ``state`` is a dict the stages of one request may share. ``deadline``
    (``time.monotonic()`` seconds), ``priority`` and ``tenant`` steer the
    runner's scheduler. ``ctx.InvalidInput(message)`` is the exception that
    refuses the request's input: a 400 whose message names the plugin.
    """

    InvalidInput: ClassVar[type[InvalidInput]] = InvalidInput

    request_id: str
    route: str
    parameters: Mapping[str, Any]
    headers: Mapping[str, str]
    content_type: str
    protocol: str = "v2"
    versions: dict[str, str] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    deadline: float | None = None
    priority: int | None = None
    tenant: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    rows: int = 0
    usage: dict[str, int] = field(default_factory=dict)
    """Tokens counted for the OpenAI routes' ``usage``: a preprocessor sets
    ``prompt_tokens`` (and ``max_tokens``, the cap it applied); the server counts a
    stream's ``completion_tokens``."""
    body_bytes: int | None = None
    """The request's size in bytes: its body as read (inflated), with the tensors it
    brought in shared memory (or, over gRPC, its tensors' bytes); ``None`` where unknown.
    A synchronous processor's cost is predicted from it
    (``registry/execution/components/inline.py``)."""
    router: Callable[..., Awaitable[Any]] | None = field(default=None, repr=False)
    """What :meth:`infer` calls (``registry/execution/graph.py``: ``RouteCaller``)."""
    depth: int = 0
    """How deep in routes calling routes this request is (0: the client's own)."""
    shadow: bool = False
    """A shadow copy of a client's request, run on a rollout's canary to compare its
    answer (``server/dataplane/shadow.py``): it serves no client, and counts in no
    runner's request statistics."""

    async def infer(self, route: str, inputs: Mapping[str, Any], version: str | None = None) -> Any:
        """Run another route's chain in this process on ``inputs`` (named tensors) and
        return its answer, as a v2 request to it would get it, without HTTP: with this
        request's deadline, priority and tenant, batched with that route's other requests.
        ``version`` pins its runner version. Any route a client can call: one whose runner
        loads on its first request loads as for a client's request, within this request's
        deadline. Errors are the route's (404 for no such route, 503 while it is not ready,
        400 for inputs it refuses, 504 past the deadline)."""
        if self.router is None:
            raise RuntimeError("ctx.infer is served by the server's data plane only")
        return await self.router(self, route, inputs, version)


BackendFactory = Callable[[PluginInfo, Mapping[str, Any], "Path | None"], Any]
"""``factory(plugin, runner, model_path) -> runner component``.

``runner`` is the manifest's ``[runner]`` table and ``model_path`` the resolved
model file, or ``None`` when the manifest names none. A factory may carry a
``model_filename`` attribute: the file a model repository version folder holds
for this backend (``model.onnx`` for ``onnxruntime``).
"""
