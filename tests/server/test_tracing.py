"""OpenTelemetry spans, captured with the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.helpers import write_add_runner, write_plugin, write_processor

EXPORTER = InMemorySpanExporter()


@pytest.fixture(autouse=True)
def spans() -> InMemorySpanExporter:
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        trace.set_tracer_provider(provider)
    EXPORTER.clear()
    return EXPORTER


X = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0, 1, 2, 3]}]}
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_a_request_span_continues_the_callers_trace_with_a_child_per_stage(
    plugins_dir: Path,
    client,
    spans: InMemorySpanExporter,  # type: ignore[no-untyped-def]
) -> None:
    write_processor(plugins_dir, "preprocessor", "pre", "1.0.0", 1)
    write_processor(plugins_dir, "postprocessor", "post", "1.0.0", 1)
    write_add_runner(
        plugins_dir, "add", "1.0.0", route='[route]\npreprocess = ["pre"]\npostprocess = ["post"]\n'
    )
    cli = await client()
    resp = await cli.post("/v2/models/add/infer", json=X, headers={"traceparent": TRACEPARENT})
    assert resp.status == 200
    finished = {s.name: s for s in spans.get_finished_spans()}
    root = finished["infer add"]
    assert root.kind == trace.SpanKind.SERVER
    assert format(root.context.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert format(root.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert root.attributes["plugserve.chain"] == "pre@1.0.0 > add@1.0.0 > post@1.0.0"
    for name in ("preprocessor pre", "runner add", "postprocessor post"):
        assert finished[name].parent.span_id == root.context.span_id, name
        assert finished[name].context.trace_id == root.context.trace_id


SLOW = """
    import asyncio
    import pluggy
    hookimpl = pluggy.HookimplMarker("plugserve")

    class Slow:
        async def infer(self, inputs):
            await asyncio.sleep(0.2)
            return {"y": inputs["x"]}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Slow()
"""


async def test_queue_waits_and_batches_are_spans_linked_to_their_requests(
    plugins_dir: Path,
    client,
    spans: InMemorySpanExporter,  # type: ignore[no-untyped-def]
) -> None:
    write_plugin(
        plugins_dir,
        "runner",
        "slow",
        "1.0.0",
        "[runner]\nmax_batch_size = 8\n",
        {"plugin.py": SLOW},
    )
    cli = await client()
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}
    first = asyncio.create_task(cli.post("/v2/models/slow/infer", json=body))
    await asyncio.sleep(0.05)  # the first runs alone; the next three queue behind it, then batch
    rest = [asyncio.create_task(cli.post("/v2/models/slow/infer", json=body)) for _ in range(3)]
    assert [r.status for r in await asyncio.gather(first, *rest)] == [200] * 4
    finished = spans.get_finished_spans()
    queue = [s for s in finished if s.name == "queue"]
    batches = [s for s in finished if s.name == "batch"]
    assert len(queue) == 3
    assert len(batches) == 1
    assert batches[0].attributes["plugserve.requests"] == 3
    assert {link.context.span_id for link in batches[0].links} == {s.context.span_id for s in queue}
    assert batches[0].parent is None  # a batch belongs to no single request
    requests = {s.context.span_id: s for s in finished if s.name == "infer slow"}
    for wait in queue:  # each wait hangs under its own request's runner stage
        runner_span = next(s for s in finished if s.context.span_id == wait.parent.span_id)
        assert runner_span.parent.span_id in requests
