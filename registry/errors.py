"""The one error hierarchy of plugserve.

Every error that can reach a client or an operator is a :class:`PlugserveError`
carrying its HTTP status. The server turns them into JSON in one middleware
(``server/http/middleware.py``); nothing else maps exceptions to statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

MAX_RETRY_AFTER_S = 3600
"""The longest ``Retry-After`` ever sent: a client told to wait longer would rather be told so."""


class PlugserveError(Exception):
    """Base class: a message, an HTTP status and optional extra JSON fields."""

    status: int = 500

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields

    def to_json(self) -> dict[str, Any]:
        return {"error": self.message, **self.fields}

    def headers(self) -> dict[str, str]:
        """HTTP headers the response carries besides the JSON body."""
        return {}


class InvalidInput(PlugserveError):
    """The request is malformed: bad JSON, shapes, datatypes, names."""

    status = 400


class StreamingOnly(InvalidInput):
    """A request for one answer to a route whose runner streams its responses: each front
    end words it with the calls of its own protocol that stream."""

    def __init__(self, route: str) -> None:
        super().__init__(f"route {route!r} streams its responses: call it for a stream")
        self.route = route


class UnreadableBody(InvalidInput):
    """The body cannot be read (a broken compressed body or chunk framing): the rest of
    it is never read, so the connection closes after the answer."""

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}


class Unauthorized(PlugserveError):
    """A call without the bearer token it needs (admin or inference), or with a wrong one."""

    status = 401

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="plugserve"'}


class Forbidden(PlugserveError):
    """An admin call from a non-loopback address while no token is configured."""

    status = 403


class NotFound(PlugserveError):
    """An unknown route, version, plugin or path."""

    status = 404


class RouteNotFound(NotFound):
    """No route of that name is served: Triton's text, which its clients look for."""

    def __init__(self, route: str) -> None:
        super().__init__(f"Request for unknown model: '{route}' is not found")
        self.route = route


class VersionNotFound(NotFound):
    """The route or plugin has no such version."""


class Conflict(PlugserveError):
    """A compare-and-swap failed: what was changed moved on since the caller read it."""

    status = 409


class PayloadTooLarge(PlugserveError):
    """The request body or a tensor exceeds a configured limit."""

    status = 413


class TooManyRequests(PlugserveError):
    """A queue is full or a rate limit applies; ``retry_after_s`` becomes ``Retry-After``,
    whole seconds from 1 to :data:`MAX_RETRY_AFTER_S`."""

    status = 429

    def __init__(self, message: str, **fields: Any) -> None:
        if "retry_after_s" in fields:
            fields["retry_after_s"] = retry_after(fields["retry_after_s"])
        super().__init__(message, **fields)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.fields.get("retry_after_s", 1))}


def retry_after(seconds: float) -> int:
    """``seconds`` rounded up into ``1..MAX_RETRY_AFTER_S`` (a non-number: 1)."""
    if isinstance(seconds, int) and not isinstance(seconds, bool):
        return min(max(seconds, 1), MAX_RETRY_AFTER_S)
    if isinstance(seconds, float) and not math.isnan(seconds):
        return MAX_RETRY_AFTER_S if seconds > MAX_RETRY_AFTER_S else max(math.ceil(seconds), 1)
    return 1


class Unavailable(PlugserveError):
    """Not ready: a stage of the chain is not loaded, failed, or is draining. A
    ``retry_after_s`` becomes ``Retry-After`` (whole seconds)."""

    status = 503

    def __init__(self, message: str, **fields: Any) -> None:
        if "retry_after_s" in fields:
            fields["retry_after_s"] = retry_after(fields["retry_after_s"])
        super().__init__(message, **fields)

    def headers(self) -> dict[str, str]:
        if "retry_after_s" not in self.fields:
            return {}
        return {"Retry-After": str(self.fields["retry_after_s"])}


class NotLoaded(Unavailable):
    """A route whose runner versions load on their first request (``load = "on_demand"``)
    and are not loaded: the data plane loads ``keys`` and resolves the route again."""

    def __init__(self, message: str, keys: tuple[tuple[str, str, str], ...]) -> None:
        super().__init__(message, retry_after_s=1)
        self.keys = keys


class DeadlineExceeded(PlugserveError):
    """The request's deadline passed before it could be answered."""

    status = 504


class PluginError(PlugserveError):
    """A plugin raised while serving a request.

    The message names the plugin, the exception type and its message; the
    traceback is logged by the server and never sent to the client.
    """

    status = 500

    def __init__(self, plugin: str, exc: BaseException) -> None:
        super().__init__(
            f"plugin {plugin} raised {type(exc).__name__}: {exc}",
            plugin=plugin,
            exception=type(exc).__name__,
        )
        self.plugin = plugin
        self.exc = exc


class RoutesTooDeep(PlugserveError):
    """Routes called routes (graph steps, ``ctx.infer``) deeper than the server allows: a
    plugin calling routes in a loop. The server's or the plugin's fault, not the client's."""

    status = 500


class PluginLoadError(PlugserveError):
    """A plugin version could not be loaded (manifest, import, create, warmup).

    Its status is 400 because an admin reload of a broken version answers 400;
    what was serving keeps serving.
    """

    status = 400


class PluginCallTimeout(PluginLoadError):
    """A call into plugin code outside a request (create, warmup, close, a hook)
    did not return within its bound; the server stopped waiting for it."""

    def __init__(self, plugin: str, call: str, seconds: float, setting: str) -> None:
        super().__init__(
            f"{plugin}: {call}() did not return within {seconds:g} s ({setting})",
            plugin=plugin,
            call=call,
        )


class ModelLoadFailed(PluginLoadError):
    """A model repository load of a route failed: Triton's wording, which its clients look for."""

    def __init__(self, route: str, reason: str) -> None:
        super().__init__(f"failed to load '{route}', {reason}")
        self.route = route


class ManifestError(PluginLoadError):
    """A ``plugin.toml`` is missing, unparsable or invalid; names file and field."""

    def __init__(self, path: object, message: str, field: str | None = None) -> None:
        where = f"{path}: {field}: " if field else f"{path}: "
        super().__init__(where + message, file=str(path), field=field)


class RoutesFileError(PlugserveError):
    """``routes.toml`` is unparsable or invalid; the previous table stays."""

    status = 400


class BackendConflict(PlugserveError):
    """Two providers claim one backend name."""

    status = 500


class RepositoryPollFailed(PlugserveError):
    """A model-control request over gRPC that the repository cannot carry out (a file
    override): Triton's gRPC answers it ``INTERNAL``, "failed to poll from model
    repository", and its clients check both."""

    status = 500


class ConfigError(PlugserveError):
    """The server's configuration (flags, TOML file, environment) is invalid."""

    status = 500


def one_error(exc: BaseException) -> BaseException:
    """The one error a request ends with when it raised ``exc``: ``exc`` itself, or for an
    exception group (a plugin's ``asyncio.TaskGroup``, say) :func:`first_error` of the
    exceptions it holds, nested groups flattened."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    return first_error(_leaves(exc))


def first_error(errors: Iterable[BaseException]) -> BaseException:
    """Of the errors of stages that ran together for one request (a graph's wave, a
    completion's choices: ``registry/execution/together.py``; routes a plugin called at
    once), the one the request ends with: the first of the highest rank.

    1. the request's own end: a :class:`DeadlineExceeded`, or an ``asyncio.CancelledError``
       (its client left, the server stops);
    2. a fault of the server or of a plugin: a status of 500 or more, or any exception that
       is no :class:`PlugserveError`;
    3. the client's error (a status under 500), only when every error is one.

    Every composition of stages, and every place that maps an error to a status (HTTP,
    gRPC, the metrics, a stage's fault), goes through this rule.
    """
    return min(errors, key=_rank)


@contextlib.contextmanager
def ungrouped() -> Iterator[None]:
    """Within it, an exception group raised is raised as its one error (:func:`one_error`)."""
    try:
        yield
    except BaseExceptionGroup as group:
        error = one_error(group)
        raise error from error.__cause__  # its own cause, not the group it came in


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


def _rank(exc: BaseException) -> int:
    if isinstance(exc, DeadlineExceeded | asyncio.CancelledError):
        return 0
    if not isinstance(exc, PlugserveError) or exc.status >= 500:
        return 1
    return 2
