"""OpenTelemetry on both ends, without servers: the producer API records the current span's
context with each event (and keeps one the caller set); the inbox's pika and aio-pika helpers
process a message in a CONSUMER span whose parent is the message's context, with the messaging
attributes and the outcome. The end-to-end trace through a real relay:
tests/integration/test_tracing.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

import pika
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)
from opentelemetry.trace import format_span_id as span_hex
from opentelemetry.trace import format_trace_id as trace_hex
from psycopg.pq import TransactionStatus

from outbox_relay import (
    Event,
    Inbox,
    InboxMessage,
    InvalidEvent,
    OnError,
    Outcome,
    enqueue,
    enqueue_async,
    enqueue_many,
)
from outbox_relay.testing import RecordingOutbox
from tests.fix_otel import spans, tracer

__all__ = ["spans"]  # the fixture, used by name

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


# -- the producer -------------------------------------------------------------------------------


def recorded_headers(outbox: RecordingOutbox) -> list[dict[str, Any]]:
    outbox.commit()
    return [event.headers for event in outbox.events]


def send(outbox: RecordingOutbox, **changes: Any) -> None:
    enqueue(outbox, exchange="orders", routing_key="order.paid", payload={"n": 1}, **changes)


def test_outside_a_span_an_event_carries_no_trace_context() -> None:
    outbox = RecordingOutbox()
    send(outbox)
    send(outbox, headers={"tenant": "a"})
    assert recorded_headers(outbox) == [{}, {"tenant": "a"}]


def test_inside_a_span_every_event_carries_its_context() -> None:
    outbox = RecordingOutbox()
    with tracer().start_as_current_span("checkout") as span:
        send(outbox)
        send(outbox, headers={"tenant": "a"})
        enqueue_many(outbox, [Event("orders", "order.paid", {"n": n}) for n in range(3)])
    context = span.get_span_context()
    expected = (f"00-{trace_hex(context.trace_id)}-{span_hex(context.span_id)}-"
                f"{context.trace_flags:02x}")
    headers = recorded_headers(outbox)
    assert [h.get("traceparent") for h in headers] == [expected] * 5
    assert headers[1] == {"tenant": "a", "traceparent": expected}
    assert all("tracestate" not in h for h in headers)  # the span has none


def test_the_tracestate_goes_with_it_and_an_unsampled_context_too() -> None:
    context = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True,
                          trace_flags=TraceFlags(0), trace_state=TraceState([("congo", "t61")]))
    outbox = RecordingOutbox()
    from opentelemetry import context as otel_context

    token = otel_context.attach(set_span_in_context(NonRecordingSpan(context)))
    try:
        send(outbox)
    finally:
        otel_context.detach(token)
    assert recorded_headers(outbox) == [{"traceparent": PARENT[:-2] + "00",
                                         "tracestate": "congo=t61"}]


def test_a_trace_context_the_caller_set_is_kept() -> None:
    outbox = RecordingOutbox()
    mine = {"traceparent": PARENT, "tracestate": "rojo=1"}
    with tracer().start_as_current_span("checkout"):
        send(outbox, headers=mine)
        send(outbox, headers={"traceparent": PARENT})  # and no tracestate of the span's added
        send(outbox, headers={"tracestate": "rojo=1", "traceparent": PARENT})
    assert recorded_headers(outbox) == [mine, {"traceparent": PARENT}, mine]


@pytest.mark.parametrize("headers", [{"traceparent": "garbage"},
                                     {"traceparent": PARENT, "tracestate": "no equals"},
                                     {"tracestate": "rojo=1"}])
def test_a_malformed_trace_context_the_caller_set_is_refused(headers: dict[str, Any]) -> None:
    outbox = RecordingOutbox()
    with tracer().start_as_current_span("checkout"), pytest.raises(InvalidEvent) as caught:
        send(outbox, headers=headers)
    assert caught.value.field == "headers"
    assert "the relay would drop it" in caught.value.reason
    assert recorded_headers(outbox) == []


def test_enqueue_async_records_the_context_of_its_call() -> None:
    outbox = RecordingOutbox()

    async def produce() -> str:
        with tracer().start_as_current_span("checkout") as span:
            pending = enqueue_async(outbox, exchange="orders", routing_key="order.paid",
                                    payload={"n": 1})
        await pending  # awaited outside the span: the event was built inside it
        return trace_hex(span.get_span_context().trace_id)

    trace_id = asyncio.run(produce())
    assert recorded_headers(outbox)[0]["traceparent"].split("-")[1] == trace_id


# -- the inbox ----------------------------------------------------------------------------------


class FakeConn:
    """What Inbox.process asks of a psycopg connection, around an overridden ``record``."""

    closed = False
    broken = False
    info = SimpleNamespace(transaction_status=TransactionStatus.IDLE)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        yield


class FakeAsyncConn(FakeConn):
    @asynccontextmanager  # type: ignore[override]
    async def transaction(self) -> AsyncIterator[None]:
        yield


class ScriptedInbox(Inbox):
    """An Inbox whose ``record`` returns the outcome the test sets (the SQL is tested against
    PostgreSQL in tests/integration/test_inbox.py)."""

    outcome = Outcome.APPLIED

    def record(self, target: Any, message: InboxMessage) -> Any:
        if isinstance(target, FakeAsyncConn):
            async def recorded() -> Outcome:
                return self.outcome
            return recorded()
        return self.outcome


class FakeChannel:
    def __init__(self) -> None:
        self.acks: list[int] = []
        self.nacks: list[tuple[int, bool]] = []

    def basic_ack(self, tag: int) -> None:
        self.acks.append(tag)

    def basic_nack(self, tag: int, requeue: bool) -> None:
        self.nacks.append((tag, requeue))


def delivery(headers: dict[str, Any] | None = None, *, message_id: str | None = "m-1",
             exchange: str = "orders", timestamp: int | None = None) -> tuple[Any, Any, bytes]:
    method = SimpleNamespace(delivery_tag=7, routing_key="order.paid", exchange=exchange,
                             redelivered=False)
    properties = pika.BasicProperties(message_id=message_id, headers=headers,
                                      timestamp=timestamp, user_id="outbox-relay")
    return method, properties, b'{"n": 1}'


def handle(inbox: Inbox, handler: Any, *args: Any, **kwargs: Any) -> tuple[Any, FakeChannel]:
    channel = FakeChannel()
    outcome = inbox.handle_pika(FakeConn(), channel, *delivery(*args, **kwargs), handler,  # type: ignore[arg-type]
                                on_error=OnError.REJECT)
    return outcome, channel


def test_the_handler_runs_in_a_consumer_span_child_of_the_message_context(
        spans: InMemorySpanExporter) -> None:
    seen: list[Any] = []

    def handler(conn: Any, message: InboxMessage) -> None:
        with tracer().start_as_current_span("apply payment") as inner:
            seen.append(inner)

    outcome, channel = handle(ScriptedInbox(consumer="billing"), handler,
                              {"traceparent": PARENT, "tracestate": "congo=t61"})

    assert outcome is Outcome.APPLIED and channel.acks == [7]
    apply, process = spans.get_finished_spans()
    assert process.name == "process orders" and process.kind is SpanKind.CONSUMER
    assert process.parent is not None and process.parent.is_remote
    assert trace_hex(process.context.trace_id) == PARENT.split("-")[1]
    assert span_hex(process.parent.span_id) == PARENT.split("-")[2]
    assert dict(process.context.trace_state) == {"congo": "t61"}
    assert apply.parent is not None and apply.parent.span_id == process.context.span_id
    assert dict(process.attributes or {}) == {
        "messaging.system": "rabbitmq", "messaging.operation.name": "process",
        "messaging.operation.type": "process", "messaging.destination.name": "orders",
        "messaging.rabbitmq.destination.routing_key": "order.paid",
        "messaging.rabbitmq.message.delivery_tag": 7, "messaging.message.id": "m-1",
        "messaging.message.body.size": 8, "outbox_relay.inbox.consumer": "billing",
        "outbox_relay.inbox.outcome": "applied"}
    assert process.status.status_code is StatusCode.UNSET


@pytest.mark.parametrize("outcome", [Outcome.DUPLICATE, Outcome.STALE])
def test_a_skipped_message_s_span_says_why(spans: InMemorySpanExporter, outcome: Outcome) -> None:
    inbox = ScriptedInbox(consumer="billing")
    inbox.outcome = outcome
    assert handle(inbox, lambda conn, message: None, {"traceparent": PARENT})[0] is outcome
    (process,) = spans.get_finished_spans()
    assert (process.attributes or {})["outbox_relay.inbox.outcome"] == outcome.value


def test_a_failing_handler_s_span_is_an_error(spans: InMemorySpanExporter) -> None:
    def handler(conn: Any, message: InboxMessage) -> None:
        raise KeyError("no such order")

    outcome, channel = handle(ScriptedInbox(consumer="billing"), handler, {"traceparent": PARENT})
    assert outcome is None and channel.nacks == [(7, False)]
    (process,) = spans.get_finished_spans()
    assert (process.attributes or {})["outbox_relay.inbox.outcome"] == "failed"
    assert (process.attributes or {})["error.type"] == "KeyError"
    assert process.status.status_code is StatusCode.ERROR
    assert [event.name for event in process.events] == ["exception"]


def test_a_message_without_a_trace_context_starts_a_trace(spans: InMemorySpanExporter) -> None:
    handle(ScriptedInbox(consumer="billing"), lambda conn, message: None, None, exchange="")
    (process,) = spans.get_finished_spans()
    assert process.parent is None and process.name == "process"


def test_a_malformed_trace_context_starts_a_trace(spans: InMemorySpanExporter) -> None:
    handle(ScriptedInbox(consumer="billing"), lambda conn, message: None,
           {"traceparent": "00-garbage"})
    (process,) = spans.get_finished_spans()
    assert process.parent is None


def test_aio_pika_messages_get_the_same_span(spans: InMemorySpanExporter) -> None:
    acked: list[str] = []

    class Incoming(SimpleNamespace):
        async def ack(self) -> None:
            acked.append("ack")

        async def nack(self, requeue: bool) -> None:
            acked.append(f"nack {requeue}")

    message = Incoming(message_id="m-2", body=b"{}", headers={"traceparent": PARENT.encode()},
                       routing_key="order.paid", exchange="orders", content_type=None,
                       redelivered=False, user_id=None, timestamp=None, delivery_tag=9,
                       type=None, correlation_id=None)

    async def handler(conn: Any, message: InboxMessage) -> None:
        pass

    outcome = asyncio.run(ScriptedInbox(consumer="billing").handle_aio_pika(
        FakeAsyncConn(), message, handler))  # type: ignore[arg-type]
    assert outcome is Outcome.APPLIED and acked == ["ack"]
    (process,) = spans.get_finished_spans()
    assert span_hex(process.parent.span_id) == PARENT.split("-")[2]  # type: ignore[union-attr]
    assert (process.attributes or {})["messaging.rabbitmq.message.delivery_tag"] == 9


# -- the inbox's metrics ----------------------------------------------------------------------


def sample(registry: Any, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else float(value)


def test_the_inbox_counts_outcomes_and_times_the_handler() -> None:
    from prometheus_client import CollectorRegistry

    from outbox_relay.inbox_metrics import InboxMetrics

    registry = CollectorRegistry()
    inbox = ScriptedInbox(consumer="billing", metrics=InboxMetrics(registry))
    # Every outcome is declared from the start.
    for outcome in ("applied", "duplicate", "stale", "failed"):
        assert registry.get_sample_value("outbox_inbox_messages_total",
                                         {"consumer": "billing", "outcome": outcome}) == 0

    created = int(datetime.now(timezone.utc).timestamp()) - 30
    handle(inbox, lambda conn, message: None, None, timestamp=created)
    inbox.outcome = Outcome.DUPLICATE
    handle(inbox, lambda conn, message: None, None, timestamp=created)
    inbox.outcome = Outcome.APPLIED

    def failing(conn: Any, message: InboxMessage) -> None:
        raise RuntimeError("boom")

    handle(inbox, failing, None)
    handle(inbox, lambda conn, message: None, None, message_id=None)  # rejected: no id

    def count(outcome: str) -> float:
        return sample(registry, "outbox_inbox_messages_total", consumer="billing",
                      outcome=outcome)

    assert [count(o) for o in ("applied", "duplicate", "stale", "failed")] == [1, 1, 0, 2]
    # The handler ran twice: applied, and raised.
    assert sample(registry, "outbox_inbox_handler_duration_seconds_count", consumer="billing") == 2
    # The age of the one applied event: 30 s by its timestamp, give or take the test's time.
    assert sample(registry, "outbox_inbox_event_age_seconds_count", consumer="billing") == 1
    age = sample(registry, "outbox_inbox_event_age_seconds_sum", consumer="billing")
    assert 30 <= age < 90


def test_two_inboxes_share_one_registry_s_metrics_by_consumer() -> None:
    from prometheus_client import CollectorRegistry

    from outbox_relay.inbox_metrics import InboxMetrics

    registry = CollectorRegistry()
    billing = ScriptedInbox(consumer="billing", metrics=InboxMetrics(registry))
    shipping = ScriptedInbox(consumer="shipping", metrics=InboxMetrics(registry))
    handle(billing, lambda conn, message: None, None)
    handle(shipping, lambda conn, message: None, None)
    handle(shipping, lambda conn, message: None, None)
    assert sample(registry, "outbox_inbox_messages_total", consumer="billing",
                  outcome="applied") == 1
    assert sample(registry, "outbox_inbox_messages_total", consumer="shipping",
                  outcome="applied") == 2


def test_an_inbox_without_metrics_measures_nothing() -> None:
    inbox = ScriptedInbox(consumer="billing")
    assert handle(inbox, lambda conn, message: None, None)[0] is Outcome.APPLIED


def test_metrics_must_be_inbox_metrics() -> None:
    from outbox_relay import ConfigError

    with pytest.raises(ConfigError, match="InboxMetrics"):
        Inbox(consumer="billing", metrics=True)  # type: ignore[arg-type]


def test_an_inbox_message_has_the_amqp_timestamp_in_utc() -> None:
    method, properties, body = delivery(timestamp=1_700_000_000)
    message = InboxMessage.from_pika(method, properties, body)
    assert message.timestamp == datetime.fromtimestamp(1_700_000_000, timezone.utc)
    assert InboxMessage.from_pika(*delivery()).timestamp is None
    assert json.loads(message.body) == {"n": 1}
