"""A gRPC call's span continues the caller's trace from its ``traceparent`` metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import numpy as np
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tritonclient.grpc import service_pb2, service_pb2_grpc

from plugserve.server.grpc_api.service import add_to_server
from tests.helpers import free_port, write_add_runner
from tests.server.test_tracing import TRACEPARENT, spans  # noqa: F401  (the fixture)


async def test_a_grpc_request_span_continues_the_callers_trace(
    plugins_dir: Path,
    client: Any,
    spans: InMemorySpanExporter,  # noqa: F811
) -> None:
    write_add_runner(plugins_dir, "add", "1.0.0")
    cli = await client()
    server = grpc.aio.server()
    add_to_server(server, cli.server.app)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            request = service_pb2.ModelInferRequest(model_name="add")
            request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
            request.raw_input_contents.append(np.arange(4, dtype=np.float32).tobytes())
            response = await stub.ModelInfer(request, metadata=(("traceparent", TRACEPARENT),))
    finally:
        await server.stop(None)
    assert np.frombuffer(response.raw_output_contents[0], "<f4").tolist() == [1, 2, 3, 4]
    finished = {s.name: s for s in spans.get_finished_spans()}
    root = finished["infer add"]
    assert root.kind == trace.SpanKind.SERVER
    assert format(root.context.trace_id, "032x") == TRACEPARENT.split("-")[1]
    assert format(root.parent.span_id, "016x") == TRACEPARENT.split("-")[2]
    assert finished["runner add"].parent.span_id == root.context.span_id
