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

- the producer: ``trace_headers()``, the current span's context as the two headers, or None;
- the consumer: ``consuming(...)``, the inbox helpers' span around a message's processing
  (kind CONSUMER, its parent the message's context, the messaging semantic conventions'
  attributes, the inbox's outcome).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import cache
from typing import Any

from outbox_relay.rules import TRACE_HEADERS, TRACEPARENT_HEADER, TRACESTATE_HEADER
from outbox_relay.version import __version__

# The instrumentation scope of the spans (the tracer's name).
TRACER_NAME = "outbox_relay"

# The span attributes of the messaging semantic conventions (and the inbox's own two).
SYSTEM = "messaging.system"
OPERATION_NAME = "messaging.operation.name"
OPERATION_TYPE = "messaging.operation.type"
DESTINATION = "messaging.destination.name"
ROUTING_KEY = "messaging.rabbitmq.destination.routing_key"
DELIVERY_TAG = "messaging.rabbitmq.message.delivery_tag"
MESSAGE_ID = "messaging.message.id"
BODY_SIZE = "messaging.message.body.size"
ERROR_TYPE = "error.type"
CONSUMER = "outbox_relay.inbox.consumer"
OUTCOME = "outbox_relay.inbox.outcome"


def in_use() -> bool:
    """True once this process has imported OpenTelemetry's trace API (else no span can be
    active and no tracer provider configured)."""
    return "opentelemetry.trace" in sys.modules


class _Otel:
    """OpenTelemetry's API, imported on first use."""

    def __init__(self) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.trace = trace
        self.consumer_kind = SpanKind.CONSUMER
        self.status, self.error_code = Status, StatusCode.ERROR
        self.propagator = TraceContextTextMapPropagator()
        # A tracer of the global provider (a proxy until the service sets one).
        self.tracer = trace.get_tracer(TRACER_NAME, __version__)


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


def _carrier(headers: Mapping[str, Any]) -> dict[str, str]:
    """A message's trace headers as text (a broker client may hand a header over as bytes)."""
    found = {}
    for name in TRACE_HEADERS:
        value = headers.get(name)
        if isinstance(value, bytes):
            value = value.decode("ascii", "replace")
        if isinstance(value, str):
            found[name] = value
    return found


class ConsumerSpan:
    """What an inbox helper tells its span: the outcome, or the error."""

    __slots__ = ("_span",)

    def __init__(self, span: Any) -> None:
        self._span = span

    def outcome(self, outcome: str) -> None:
        if self._span is not None:
            self._span.set_attribute(OUTCOME, outcome)

    def failed(self, exc: BaseException) -> None:
        if self._span is not None:
            otel = _otel()
            self._span.set_attribute(OUTCOME, "failed")
            self._span.set_attribute(ERROR_TYPE, type(exc).__qualname__)
            self._span.record_exception(exc)
            self._span.set_status(otel.status(otel.error_code, type(exc).__qualname__))


_UNTRACED = ConsumerSpan(None)


@contextmanager
def consuming(*, consumer: str, message_id: str, exchange: str, routing_key: str,
              headers: Mapping[str, Any], body_size: int,
              delivery_tag: int | None = None) -> Iterator[ConsumerSpan]:
    """The span of one message's processing by an inbox helper, current while it runs (the
    handler's own spans are its children): kind CONSUMER, named ``process <exchange>``, its
    parent the message's trace context (headers traceparent, tracestate; a new trace without
    one). Exceptions pass through; the helper reports its outcome or error."""
    if not in_use():
        yield _UNTRACED
        return
    otel = _otel()
    attributes: dict[str, Any] = {
        SYSTEM: "rabbitmq", OPERATION_NAME: "process", OPERATION_TYPE: "process",
        DESTINATION: exchange, MESSAGE_ID: message_id, BODY_SIZE: body_size,
        CONSUMER: consumer}
    if routing_key:
        attributes[ROUTING_KEY] = routing_key
    if delivery_tag is not None:
        attributes[DELIVERY_TAG] = delivery_tag
    parent = otel.propagator.extract(_carrier(headers))
    with otel.tracer.start_as_current_span(
            f"process {exchange}" if exchange else "process", context=parent,
            kind=otel.consumer_kind, attributes=attributes) as span:
        yield ConsumerSpan(span)


__all__ = ["TRACEPARENT_HEADER", "TRACESTATE_HEADER", "ConsumerSpan", "consuming", "in_use",
           "trace_headers"]
