"""OpenTelemetry for the services' library and the relay: optional (the extra ``otel``),
loaded only by a process that uses it.

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
  attributes, the inbox's outcome);
- the relay: ``publishing(...)``, a span per batch published (kind PRODUCER), linked to the
  context of each of its events, when the relay runs with OpenTelemetry's SDK set up
  (``opentelemetry-instrument outbox-relay run``: docs/operations.md#traces).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cache
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from outbox_relay.rules import TRACE_HEADERS, TRACEPARENT_HEADER, TRACESTATE_HEADER
from outbox_relay.version import __version__

if TYPE_CHECKING:
    from outbox_relay.model import Message, PublishResult

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
BATCH_COUNT = "messaging.batch.message_count"
ERROR_TYPE = "error.type"
CONSUMER = "outbox_relay.inbox.consumer"
OUTCOME = "outbox_relay.inbox.outcome"
GID = "outbox_relay.gid"
CONFIRMED = "outbox_relay.confirmed_count"


def in_use() -> bool:
    """True once this process has imported OpenTelemetry's trace API (else no span can be
    active and no tracer provider configured)."""
    return "opentelemetry.trace" in sys.modules


class _Otel:
    """OpenTelemetry's API, imported on first use."""

    def __init__(self) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.trace = trace
        self.consumer_kind, self.producer_kind = SpanKind.CONSUMER, SpanKind.PRODUCER
        self.span_context, self.trace_flags = SpanContext, TraceFlags
        self.link_limit = _link_limit(os.environ.get("OTEL_SPAN_LINK_COUNT_LIMIT", ""))
        self.status, self.error_code = Status, StatusCode.ERROR
        self.propagator = TraceContextTextMapPropagator()
        # A tracer of the global provider (a proxy until the service sets one).
        self.tracer = trace.get_tracer(TRACER_NAME, __version__)


_EXCHANGE = attrgetter("exchange")

# OpenTelemetry's default for OTEL_SPAN_LINK_COUNT_LIMIT.
LINK_LIMIT = 128


def _link_limit(text: str) -> int:
    """The links a span keeps (the SDK's setting): a batch's span is given no more, since
    making the others costs as much and the SDK drops them."""
    try:
        return max(int(text), 0) if text.strip() else LINK_LIMIT
    except ValueError:
        return LINK_LIMIT


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


class PublishSpan:
    """What the relay tells its batch's span: what the broker did."""

    __slots__ = ("_span",)

    def __init__(self, span: Any) -> None:
        self._span = span

    def result(self, result: PublishResult, sent: int) -> None:
        if self._span is None:
            return
        self._span.set_attribute(CONFIRMED, len(result.confirmed))
        if result.transient is not None or result.failed or result.suspect \
                or len(result.confirmed) < sent:
            failure = result.transient or next(iter({**result.failed, **result.suspect}.values()),
                                               None)
            reason = str(failure.reason) if failure is not None else "unconfirmed"
            otel = _otel()
            self._span.set_attribute(ERROR_TYPE, reason)
            self._span.set_status(otel.status(otel.error_code, str(failure or reason)))


_UNPUBLISHED = PublishSpan(None)


def _linked(otel: _Otel, messages: Sequence[Message]) -> Iterator[Any]:
    """The producer's context of each message that carries one, as its relay checked it
    (outbox_relay.rules.trace_context_problem: version-traceid-parentid-flags), up to the
    link limit."""
    left = otel.link_limit
    for message in messages:
        if left <= 0:
            return
        parent = getattr(message, "traceparent", None)  # a TracedMessage's
        if parent:
            left -= 1
            yield otel.span_context(int(parent[3:35], 16), int(parent[36:52], 16),
                                    is_remote=True,
                                    trace_flags=otel.trace_flags(int(parent[53:55], 16)))


@contextmanager
def publishing(messages: Sequence[Message], *, gid: str) -> Iterator[PublishSpan]:
    """The relay's span of one batch's publish (step 3: every message out, every confirm
    back), when the process uses OpenTelemetry: kind PRODUCER, named ``publish <exchange>``
    (``publish`` when the batch goes to several), a root span linked to the producer's
    context of each event (its first 128, OTEL_SPAN_LINK_COUNT_LIMIT's default: the SDK
    keeps no more). Nothing at all, for a dictionary lookup, in a relay without it."""
    if not in_use():
        yield _UNPUBLISHED
        return
    otel = _otel()
    exchanges = set(map(_EXCHANGE, messages))
    attributes: dict[str, Any] = {SYSTEM: "rabbitmq", OPERATION_NAME: "publish",
                                  OPERATION_TYPE: "send", BATCH_COUNT: len(messages), GID: gid}
    name = "publish"
    if len(exchanges) == 1:
        (exchange,) = exchanges
        attributes[DESTINATION] = exchange
        name = f"publish {exchange}" if exchange else name
    # A root span: the batch is the relay's own work, each event's trace is a link away.
    with otel.tracer.start_as_current_span(name, context=otel.trace.set_span_in_context(
            otel.trace.INVALID_SPAN), kind=otel.producer_kind, attributes=attributes) as span:
        if span.is_recording():  # an SDK set up, and this batch sampled
            for context in _linked(otel, messages):
                span.add_link(context)
        yield PublishSpan(span)


__all__ = ["TRACEPARENT_HEADER", "TRACESTATE_HEADER", "ConsumerSpan", "PublishSpan", "consuming",
           "in_use", "publishing", "trace_headers"]
