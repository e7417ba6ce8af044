"""OpenTelemetry for the services' library: optional (the extra ``otel``), loaded only by a
process that uses it.

OpenTelemetry is the one tracing API here, and the W3C Trace Context its format, whatever
propagators the service configured: the event carries ``traceparent`` (and ``tracestate``) as
headers, which the relay checks and publishes (outbox_relay.rules.trace_context_problem) and a
consumer in any language reads.

Nothing here imports opentelemetry until a process has imported it itself: a span can only be
active, or a tracer provider configured, in a process that has. ``"opentelemetry.trace" in
sys.modules`` answers "could a span be active?" for a dictionary lookup, so a service without
OpenTelemetry (or with it installed and unused) pays nothing and loads nothing
(tests/unit/test_imports.py).

- the producer: ``trace_headers()``, the current span's context as the two headers, or None.
"""

from __future__ import annotations

import sys
from functools import cache

from outbox_relay.rules import TRACEPARENT_HEADER, TRACESTATE_HEADER


def in_use() -> bool:
    """True once this process has imported OpenTelemetry's trace API (else no span can be
    active and no tracer provider configured)."""
    return "opentelemetry.trace" in sys.modules


class _Otel:
    """OpenTelemetry's API, imported on first use."""

    def __init__(self) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.trace = trace
        self.propagator = TraceContextTextMapPropagator()


@cache
def _otel() -> _Otel:
    return _Otel()


def trace_headers() -> dict[str, str] | None:
    """The current span's context as W3C Trace Context headers (``traceparent``, and
    ``tracestate`` when it has one), or None when no span is active (nor could be: OpenTelemetry
    not imported)."""
    if not in_use():
        return None
    otel = _otel()
    if not otel.trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    otel.propagator.inject(carrier)
    return carrier or None


__all__ = ["TRACEPARENT_HEADER", "TRACESTATE_HEADER", "in_use", "trace_headers"]
