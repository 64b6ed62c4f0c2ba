"""OpenTelemetry tracing, when the ``plugserve[otel]`` extra is installed; nothing otherwise.

Spans: one per request (its W3C ``traceparent`` continued), one per chain stage,
one for the wait in a runner's queue, and one per batch execution linked to the
requests it carried. Exporters and sampling are the operator's, configured the
standard OpenTelemetry way (``opentelemetry-instrument`` and ``OTEL_*``
environment variables, or any SDK setup before the server starts). Without the
extra, :data:`TRACER` is ``None`` and the request path checks only that.
"""

from __future__ import annotations

from typing import Any

try:
    from opentelemetry import trace
    from opentelemetry.context import Context

    TRACER: Any = trace.get_tracer("plugserve")
    ROOT: Any = Context()  # a batch serves several requests: it is no one's child
except ImportError:  # the extra is not installed: tracing is off at no cost
    trace = None  # type: ignore[assignment]
    TRACER = ROOT = None


def configure() -> bool:
    """Trace only when an SDK tracer provider is set (by ``opentelemetry-instrument`` or
    the operator's code); with the API alone every span would be a no-op, so skip them.
    Called when the server starts. Returns whether tracing is on."""
    global TRACER
    if trace is None:
        return False
    configured = not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    TRACER = trace.get_tracer("plugserve") if configured else None
    return configured


def inject() -> dict[str, str]:
    """The current trace context as W3C headers (``traceparent``), to cross a process."""
    carrier: dict[str, str] = {}
    if trace is not None:
        from opentelemetry import propagate

        propagate.inject(carrier)
    return carrier


def attach(carrier: dict[str, str]) -> Any:
    """Make the trace context another process sent the current one; returns the token
    for :func:`detach`."""
    from opentelemetry import context, propagate

    return context.attach(propagate.extract(carrier))


def detach(token: Any) -> None:
    from opentelemetry import context

    context.detach(token)


def current_context() -> Any:
    """The span context of the current span (to link a batch to its requests)."""
    return trace.get_current_span().get_span_context() if trace is not None else None


def link(context: Any) -> Any:
    return trace.Link(context) if trace is not None else None
