"""Triton's ``inference.GRPCInferenceService`` over the same chains, limits and rules as HTTP.

Every call runs on the server's event loop (``grpc.aio``), in the worker that
accepted its connection. Inference goes through the data plane
(:mod:`plugserve.server.dataplane.plane`: admission, rate limits, deadline, priority, tenant, the
drain, metrics with ``protocol="grpc"``, tracing from a ``traceparent`` in the
metadata), and errors leave as gRPC status codes (:mod:`plugserve.server.grpc_api.calls`).
The data plane needs the inference token (``authorization: Bearer ...``
metadata) where one is configured; the repository calls are the control
plane's, under the admin rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import structlog
from aiohttp import web
from google.protobuf import json_format

from plugserve.registry.errors import (
    DeadlineExceeded,
    InvalidInput,
    NotFound,
    PayloadTooLarge,
    PlugserveError,
    RepositoryPollFailed,
    Unavailable,
    ungrouped,
)
from plugserve.registry.execution.chain import Chain
from plugserve.server.dataplane.outcomes import log_failure
from plugserve.server.dataplane.plane import DATA_PLANE, Inference, Served
from plugserve.server.grpc_api import handlers, prescan, tensors
from plugserve.server.grpc_api.admission import CURRENT_CALL, TrackedCall, end_with
from plugserve.server.grpc_api.calls import Call, error_details, grpc_code
from plugserve.server.grpc_api.generated import grpc_service_pb2 as pb
from plugserve.server.grpc_api.generated import grpc_service_pb2_grpc as pb_grpc
from plugserve.server.grpc_api.generated import health_pb2, health_pb2_grpc
from plugserve.server.http import auth
from plugserve.server.http.bodies import BODIES, CONTROL_BODY_BYTES, LARGE_BODY_BYTES
from plugserve.server.runtime.logs import (
    REQUEST_CHAIN,
    REQUEST_ID,
    REQUEST_ID_HEADER,
    client_request_id,
    new_request_id,
)
from plugserve.server.state import REGISTRY, SETTINGS
from plugserve.server.triton import answers, classification, config
from plugserve.server.triton.answers import READINESS
from plugserve.server.triton.repository import REPOSITORY
from plugserve.server.triton.requests import InferRequest
from plugserve.server.triton.shared_memory import (
    REGIONS,
    Attachment,
    Regions,
    check_key,
    cuda_unsupported,
)
from plugserve.server.triton.statistics import STATISTICS

T = TypeVar("T")
log = structlog.get_logger("plugserve.grpc")

DEADLINE_SLACK_S = 0.002
"""How near its gRPC deadline a call counts as ended by it (:func:`_expired`)."""

STREAM_IN_FLIGHT = 64
"""Requests of one ``ModelStreamInfer`` stream running at once; the stream's next request is
not read until one finishes (backpressure to the client through gRPC's flow control)."""

STOP_WAIT_S = 5.0
"""How long a call the server ends waits for its requests to stop before its status goes."""

WRITE_FAILED_GRACE_S = 1.0
"""How long a stream's failed write waits for gRPC to report that its client hung up."""

DECOUPLED_UNARY = "ModelInfer RPC doesn't support models with decoupled transaction policy"
"""Triton's words for a unary call to a decoupled model (a streaming route here)."""

PROTOCOL = "grpc"

Send = Callable[[pb.ModelStreamInferResponse], Awaitable[None]]
"""Writes one answer on a ``ModelStreamInfer`` stream."""


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    """The KServe v2 gRPC service of one process (a worker, or the single server)."""

    def __init__(self, app: web.Application, port: int | None = None) -> None:
        self.app = app
        self.port = port
        """The port this service listens on (the admin rules compare it with admin_port)."""
        self.tokens = auth.data_plane_tokens(app[SETTINGS])
        self.plane = app[DATA_PLANE]

    # -- plumbing ---------------------------------------------------------------------

    def _call(self, context: Any, admin: bool = False) -> Call:
        """The call, its request id bound, and its token checked: the inference token, or
        with ``admin`` the control plane's rules (as HTTP's /admin)."""
        call = Call(self.app, context)
        request_id = client_request_id(call.headers.get(REQUEST_ID_HEADER)) or new_request_id()
        REQUEST_ID.set(request_id)
        REQUEST_CHAIN.set(None)
        token = auth.bearer(call.headers.get("authorization"))
        if admin:
            auth.check_admin_call(self.app[SETTINGS], self.port, call.peer[0], token)
        else:
            auth.check_inference_token(token, self.tokens, header="authorization")
        return call

    async def _answer(self, context: Any, method: str, work: Callable[[], Awaitable[T]]) -> T:
        """Run ``work``; its :class:`PlugserveError` (or a fault) ends the call with a status
        (an exception group's: its one error, :func:`one_error`)."""
        try:
            with ungrouped():
                return await work()
        except PlugserveError as exc:
            log_failure(exc, rpc=method)
            if isinstance(exc, DeadlineExceeded) and _expired(context):
                # The call's own gRPC deadline: gRPC ends it with DEADLINE_EXCEEDED itself,
                # and an abort that races that end fails in gRPC's core, which logs the
                # failure with a traceback. Ended quietly instead (gRPC logs at debug).
                raise asyncio.CancelledError from None
            for key, value in exc.headers().items():
                if key.lower() == "retry-after":
                    context.set_trailing_metadata((("retry-after", value),))
            await context.abort(grpc_code(exc.status), error_details(exc))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            log_failure(exc, rpc=method)
            await context.abort(grpc.StatusCode.INTERNAL, "internal server error")
        raise AssertionError("unreachable: abort() raises")  # pragma: no cover

    # -- health and metadata ----------------------------------------------------------

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=await self._ready())

    async def _ready(self) -> bool:
        return await self.app[READINESS].ready()

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> Any:
        async def work() -> Any:
            self._call(context)
            try:
                self._resolve(request.name, request.version)
            except (NotFound, Unavailable):
                return pb.ModelReadyResponse(ready=False)
            return pb.ModelReadyResponse(ready=True)

        return await self._answer(context, "ModelReady", work)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Any) -> Any:
        async def work() -> Any:
            self._call(context)
            return pb.ServerMetadataResponse(**answers.server_metadata())

        return await self._answer(context, "ServerMetadata", work)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> Any:
        async def work() -> Any:
            self._call(context)
            chain = await self._loaded(request.name, request.version)
            doc = answers.metadata(self.app[REGISTRY].routes, chain)
            response = pb.ModelMetadataResponse(
                name=doc["name"], versions=doc["versions"], platform=doc["platform"]
            )
            for side in ("inputs", "outputs"):
                for spec in doc[side]:
                    getattr(response, side).add(
                        name=spec["name"], datatype=spec["datatype"], shape=spec["shape"]
                    )
            return response

        return await self._answer(context, "ModelMetadata", work)

    def _resolve(self, name: str, version: str) -> Chain:
        return self.app[REGISTRY].routes.resolve(name, version or None)

    async def _loaded(self, name: str, version: str) -> Chain:
        """The route's chain, loading what loads on its first request."""
        return await self.app[DATA_PLANE].chain_of(name, version or None)

    # -- inference --------------------------------------------------------------------

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> Any:
        async def work() -> Any:
            call = self._call(context)
            return await self._infer(call, request)

        return await self._answer(context, "ModelInfer", work)

    async def _infer(
        self, call: Call, request: pb.ModelInferRequest, send: Send | None = None
    ) -> pb.ModelInferResponse | None:
        """The request's one answer; a streaming route's answers go to ``send`` (a
        ``ModelStreamInfer`` call) and this returns ``None``."""
        decoded: InferRequest
        shared: Attachment | None = None
        classes: dict[str, int] | None = None

        async def read(served: Served) -> Inference:
            nonlocal decoded, shared, classes
            decoded = tensors.decode(request, self.app[SETTINGS].limits)
            classes = decoded.classifications() if decoded.outputs else None
            size = request.ByteSize()  # the message as it arrived, as HTTP counts its body
            if decoded.uses_shared_memory:
                shared = await self._attach(call, decoded)
                size += shared.input_bytes
            return Inference(
                request.model_name, decoded.inputs, decoded.parameters, size, _deadline(call)
            )

        async def encoded(chain: Chain, result: Any) -> pb.ModelInferResponse:
            outputs = answers.named_outputs(chain, result)
            if classes:
                outputs = classification.classify_outputs(chain, outputs, classes)
            if shared is not None:
                await self._off_loop(shared.output_bytes(outputs), shared.write_outputs, outputs)
            return tensors.encode(decoded, chain.route, chain.runner_version, outputs)

        async def answer(served: Served) -> pb.ModelInferResponse | None:
            chain = served.chain
            if not chain.streaming:
                return await encoded(chain, await served.result())
            if send is None:
                raise InvalidInput(
                    f"{DECOUPLED_UNARY}: route {chain.route!r} streams its responses, "
                    "call ModelStreamInfer"
                )
            # A stream's deadline bounds the whole stream: past it, it closes (its runner
            # stops before the next step) and the request answers DEADLINE_EXCEEDED.
            async with contextlib.aclosing(served.responses()) as results:
                async for result in results:
                    await send(_final(await encoded(chain, result), False))
            if decoded.parameters.get(EMPTY_FINAL) is True:
                empty = pb.ModelInferResponse(
                    model_name=chain.route, model_version=chain.runner_version
                )
                empty.id = request.id
                await send(_final(empty, True))
            return None

        route, version = request.model_name, request.model_version or None
        return await self.plane.infer(call, PROTOCOL, read, answer, route, version)

    async def _attach(self, call: Call, decoded: InferRequest) -> Attachment:
        """The request's tensors in shared memory: inputs read, output regions held."""
        regions = self._regions(call)
        attached = regions.attach(decoded)
        await self._off_loop(attached.input_bytes, attached.read_inputs, decoded)
        return attached

    def _regions(self, call: Call) -> Regions:
        regions = self.app[REGIONS]
        regions.admit(*call.peer)
        return regions

    async def _off_loop(self, size: int, work: Callable[[T], None], arg: T) -> None:
        """``work(arg)``, on the body threads when ``size`` bytes make it large."""
        if size > LARGE_BODY_BYTES:
            await self.app[BODIES].run(lambda: work(arg))
        else:
            work(arg)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> None:
        """Each request of the stream runs as it arrives (up to ``STREAM_IN_FLIGHT`` at
        once) and its answers are written as they come, requests interleaved: one for a
        route that answers once, one per response, in order, for a streaming route (Triton's
        decoupled models). A failed request answers ``error_message`` and the stream goes
        on, as Triton's does; a client that cancels the call closes every stream it had open.
        """
        try:
            self._call(context)
        except PlugserveError as exc:
            await context.abort(grpc_code(exc.status), error_details(exc))
        tracked = CURRENT_CALL.get()
        slots = asyncio.Semaphore(STREAM_IN_FLIGHT)
        writing = asyncio.Lock()
        running: set[asyncio.Task[None]] = set()

        async def send(answer: pb.ModelStreamInferResponse) -> None:
            async with writing:
                await _write_whole(context, answer, tracked)

        # A sequence's requests in one stream run in the stream's order, each once the one
        # before it is answered (its turn in the sequence is taken in that order, whatever
        # the requests' decoding and queueing): the sequence's last request, by its id.
        last_of: dict[tuple[str, Any], asyncio.Future[None]] = {}

        async def one(
            request: pb.ModelInferRequest,
            after: asyncio.Future[None] | None = None,
            done: asyncio.Future[None] | None = None,
        ) -> None:
            try:
                if after is not None:
                    await after
                try:
                    call = self._call(context)
                    with ungrouped():
                        response = await self._infer(call, request, send)
                    if response is not None:
                        await send(_final(response, True))
                except PlugserveError as exc:
                    log_failure(exc, rpc="ModelStreamInfer")
                    await send(_failed(request, error_details(exc)))
                except Exception as exc:
                    log_failure(exc, rpc="ModelStreamInfer")
                    await send(_failed(request, "internal server error"))
            finally:
                slots.release()
                if tracked is not None:
                    tracked.request_ended()
                if done is not None:
                    done.set_result(None)

        try:
            async for request in requests:
                if tracked is not None:
                    tracked.request_began()
                await slots.acquire()
                key = _sequence_key(request)
                after = done = None
                if key is not None:
                    after = last_of.get(key)
                    if after is not None and after.done():
                        after = None
                    done = last_of[key] = asyncio.get_running_loop().create_future()
                    if len(last_of) > STREAM_IN_FLIGHT:  # those answered are forgotten
                        for kept, future in list(last_of.items()):
                            if future.done():
                                del last_of[kept]
                task = asyncio.create_task(one(request, after, done))
                running.add(task)
                task.add_done_callback(running.discard)
            if running:
                await asyncio.gather(*running, return_exceptions=True)
        except asyncio.CancelledError:
            ended = tracked.ended if tracked is not None else None
            if ended is None:
                raise  # the client went away, or the server stops
            _uncancel()
            await _stop_all(running)
            await end_with(context, ended)
        finally:
            for task in running:  # the client went away: its streams close
                task.cancel()

    # -- statistics and configuration -------------------------------------------------

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Any) -> Any:
        async def work() -> Any:
            self._call(context)
            name, version = request.name or None, request.version or None
            doc = await self.app[STATISTICS].of(name, version)
            return json_format.ParseDict(
                doc, pb.ModelStatisticsResponse(), ignore_unknown_fields=True
            )

        return await self._answer(context, "ModelStatistics", work)

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Any) -> Any:
        async def work() -> Any:
            self._call(context)
            doc = config.model_config(await self._loaded(request.name, request.version))
            response = pb.ModelConfigResponse()
            json_format.ParseDict(doc, response.config)
            return response

        return await self._answer(context, "ModelConfig", work)

    # -- model repository (the control plane's) ----------------------------------------

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Any) -> Any:
        async def work() -> Any:
            self._call(context, admin=True)
            rows = await self.app[REPOSITORY].index(request.ready)
            response = pb.RepositoryIndexResponse()
            for row in rows:
                response.models.add(**{k: str(v) for k, v in row.items() if v is not None})
            return response

        return await self._answer(context, "RepositoryIndex", work)

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Any
    ) -> Any:
        async def work() -> Any:
            self._call(context, admin=True)
            files = sorted(k for k in request.parameters if k.startswith("file:"))
            if files:  # Triton's words and code, which its model-control example checks
                shown = ", ".join(name[:64] for name in files[:8])
                raise RepositoryPollFailed(
                    f"failed to poll from model repository: file overrides are not "
                    f"supported ({shown}): a route's files are its plugin folder"
                )
            given = None
            if "config" in request.parameters:
                parameter = request.parameters["config"]
                if parameter.WhichOneof("parameter_choice") != "string_param":
                    raise InvalidInput("parameter 'config' must be a string holding the JSON")
                given = parameter.string_param
                if len(given.encode()) > CONTROL_BODY_BYTES:  # parsed on the event loop
                    limit = CONTROL_BODY_BYTES
                    raise PayloadTooLarge(f"parameter 'config' is at most {limit} bytes")
            await self.app[REPOSITORY].load(request.model_name, given)
            return pb.RepositoryModelLoadResponse()

        return await self._answer(context, "RepositoryModelLoad", work)

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Any
    ) -> Any:
        async def work() -> Any:
            self._call(context, admin=True)
            await self.app[REPOSITORY].unload(request.model_name)
            return pb.RepositoryModelUnloadResponse()

        return await self._answer(context, "RepositoryModelUnload", work)

    # -- shared memory ----------------------------------------------------------------

    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            regions = self._regions(self._call(context))
            key = check_key(request.key)
            await regions.register_call(request.name, key, request.offset, request.byte_size)
            return pb.SystemSharedMemoryRegisterResponse()

        return await self._answer(context, "SystemSharedMemoryRegister", work)

    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            regions = self._regions(self._call(context))
            response = pb.SystemSharedMemoryStatusResponse()
            for row in regions.status(request.name or None):
                response.regions[row["name"]].CopyFrom(
                    pb.SystemSharedMemoryStatusResponse.RegionStatus(**row)
                )
            return response

        return await self._answer(context, "SystemSharedMemoryStatus", work)

    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            await self._regions(self._call(context)).unregister_call(request.name or None)
            return pb.SystemSharedMemoryUnregisterResponse()

        return await self._answer(context, "SystemSharedMemoryUnregister", work)

    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            self._call(context)
            raise InvalidInput(cuda_unsupported(request.name))

        return await self._answer(context, "CudaSharedMemoryRegister", work)

    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            self._call(context)
            if request.name:
                raise NotFound(f"Unable to find cuda shared memory region: '{request.name}'")
            return pb.CudaSharedMemoryStatusResponse()

        return await self._answer(context, "CudaSharedMemoryStatus", work)

    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            self._call(context)
            return pb.CudaSharedMemoryUnregisterResponse()

        return await self._answer(context, "CudaSharedMemoryUnregister", work)

    # -- not offered ------------------------------------------------------------------

    async def TraceSetting(self, request: Any, context: Any) -> Any:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "trace settings are not offered: plugserve traces with OpenTelemetry "
            "(docs/operations.md)",
        )

    async def LogSettings(self, request: Any, context: Any) -> Any:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "log settings are not offered: set log_level in the config",
        )


SERVICES = ("", "inference.GRPCInferenceService")
"""What the health check answers for: the server (``""``) and its one service."""


class HealthService(health_pb2_grpc.HealthServicer):
    """gRPC's standard health check (``grpc.health.v1``): SERVING when the server is ready."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service

    async def Check(self, request: Any, context: Any) -> Any:
        if request.service not in SERVICES:  # as the health protocol says
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        status = health_pb2.HealthCheckResponse
        ready = await self.service._ready()
        return status(status=status.SERVING if ready else status.NOT_SERVING)


def _deadline(call: Call) -> float | None:
    """The call's own gRPC deadline, if it has one: the request's budget is the smallest of
    it, the ``timeout`` parameter (µs) and the ``x-request-timeout`` metadata (s)."""
    remaining: float | None = call.context.time_remaining()
    if remaining is not None and math.isfinite(remaining):
        return max(remaining, 1e-6)
    return None


async def _write_whole(
    context: Any, answer: pb.ModelStreamInferResponse, tracked: TrackedCall | None = None
) -> None:
    """``context.write(answer)``, finished even when its request stops meanwhile (its
    deadline passed while a slow client held the write): a write cut short leaves gRPC's
    send in flight, and the stream's next write fails (``TOO_MANY_OPERATIONS``). When the
    server has ended the whole call (``tracked.ended``) the write is left to gRPC: nothing
    follows it, and its client may never read it."""
    write = asyncio.ensure_future(context.write(answer))
    write.add_done_callback(_retrieved)
    if tracked is not None:
        tracked.write_began()
    try:
        await asyncio.shield(write)
    except asyncio.CancelledError:
        if tracked is None or tracked.ended is None:
            await asyncio.wait([write])
        raise
    except Exception:
        if context.done():  # the server has sent the call's status: nothing more goes out
            raise asyncio.CancelledError from None
        # gRPC's core fails a write to a call that its client cancelled, or whose deadline
        # passed (``ExecuteBatchError``), and tells the handler a moment later, by
        # cancelling its task (which cancels this request's). Waiting for that turns the
        # hang-up into one (counted 499, no traceback); a write that fails on a call still
        # live after the wait is a fault.
        await asyncio.sleep(WRITE_FAILED_GRACE_S)
        raise
    finally:
        if tracked is not None:
            tracked.write_ended()


def _retrieved(write: asyncio.Future[None]) -> None:
    """A write's failure read, so that asyncio does not log it: the request is over."""
    if not write.cancelled():
        write.exception()


def _uncancel() -> None:
    """Take back the cancellation that ended the call, so the handler can send its status."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


async def _stop_all(running: set[asyncio.Task[None]]) -> None:
    """Cancel the call's requests (their streams close, their runners' slots free) and wait
    for them, at most ``STOP_WAIT_S``."""
    for task in running:
        task.cancel()
    if running:
        await asyncio.wait(running, timeout=STOP_WAIT_S)


EMPTY_FINAL = "triton_enable_empty_final_response"
"""A request's parameter (``true``): after its last response, an empty one marked final."""
FINAL = "triton_final_response"
"""The parameter of each answer on the stream: whether it is its request's last."""


def _sequence_key(request: pb.ModelInferRequest) -> tuple[str, Any] | None:
    """The sequence a stream's request belongs to (its ``sequence_id`` parameter), if any."""
    if "sequence_id" not in request.parameters:
        return None
    parameter = request.parameters["sequence_id"]
    which = parameter.WhichOneof("parameter_choice")
    value = getattr(parameter, which) if which else None
    return None if value in (None, 0, "") else (which or "", value)


def _final(response: pb.ModelInferResponse, final: bool) -> pb.ModelStreamInferResponse:
    """An answer on the stream, with ``triton_final_response`` as Triton sets it."""
    response.parameters[FINAL].bool_param = final
    return pb.ModelStreamInferResponse(infer_response=response)


def _failed(request: pb.ModelInferRequest, message: str) -> pb.ModelStreamInferResponse:
    """A request's error on the stream: its last answer, naming the request."""
    response = pb.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )
    response.parameters[FINAL].bool_param = True
    return pb.ModelStreamInferResponse(error_message=message, infer_response=response)


def _expired(context: Any) -> bool:
    """Whether the call's gRPC deadline has passed, or is about to: timers may fire up to a
    millisecond early (uvloop's resolution), and gRPC ends the call within that anyway."""
    remaining = context.time_remaining()
    return remaining is not None and remaining < DEADLINE_SLACK_S


def served_methods(app: web.Application, port: int | None = None) -> list[handlers.Method]:
    """Every method of the inference and health services of ``app`` (the native server's)."""
    return _methods(InferenceService(app, port))


def _methods(service: InferenceService) -> list[handlers.Method]:
    infer = pb.ModelInferRequest.DESCRIPTOR
    checks = {infer.full_name: prescan.bounds(infer, service.app[SETTINGS].limits)}
    return [
        *handlers.methods(pb.DESCRIPTOR.services_by_name["GRPCInferenceService"], service, checks),
        *handlers.methods(health_pb2.DESCRIPTOR.services_by_name["Health"], HealthService(service)),
    ]


def reader(app: web.Application) -> handlers.Reader:
    """How ``app``'s gRPC engine reads large and compressed request messages."""
    bodies = app[BODIES]
    return handlers.Reader(app[SETTINGS].max_body_bytes, bodies.read_message, bodies.budget)


def add_to_server(server: Any, app: web.Application, port: int | None = None) -> InferenceService:
    """Register the inference and health services of ``app`` on a ``grpc.aio`` server that
    listens on ``port``."""
    service = InferenceService(app, port)
    handlers.register(server, _methods(service), reader(app))
    return service
