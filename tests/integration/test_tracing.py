"""One trace from the producer's transaction to the consumer's handler, through the real relay:
the producer enqueues inside its span (OpenTelemetry's SDK, an in-memory exporter), the relay
CLI (a subprocess) publishes the events with their trace context, and the inbox consumes them
in this process: each handler runs in a consumer span whose parent is the producer's span. The
first test's relay has the SDK set up too (devenv/traced_relay.py, its spans to a file): its
batch's publish span links to the producer's. A row written by a producer in another language
carries its own traceparent; one with a malformed traceparent is published without it, and
counted.

``OUTBOX_TEST_TRACE_PNG=docs/images/trace.png`` draws the spans of the first test as the
picture in docs/python-api.md (devenv/trace_picture.py; matplotlib, of the bench group).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, format_span_id, format_trace_id
from prometheus_client import CollectorRegistry
from psycopg import sql
from psycopg.types.json import Jsonb

from devenv import trace_picture
from devenv.servers import free_port
from devenv.traced_relay import SPANS_FILE, read_spans
from outbox_relay import Event, Inbox, InboxMessage, Outcome, enqueue, enqueue_many
from outbox_relay.inbox_metrics import InboxMetrics
from tests.acceptance.test_metrics import scrape
from tests.conftest import Env
from tests.fix_otel import spans, tracer
from tests.integration.test_hostile_rows import insert
from tests.integration.test_pipeline import log_of, outbox_count, stop, wait_until

__all__ = ["spans"]  # the fixture, used by name

FOREIGN_PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def consume(env: Env, inbox: Inbox, count: int) -> dict[str, Outcome | None]:
    """Run the inbox's pika helper on ``count`` messages of the test's queue; each handler
    opens a span of its own, as a service's code (or its database instrumentation) would."""
    outcomes: dict[str, Outcome | None] = {}

    def apply_payment(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        with tracer().start_as_current_span("apply payment"):
            conn.execute("SELECT pg_catalog.pg_sleep(0.002)")

    with psycopg.connect(env.db_url, autocommit=True) as db:
        conn, channel = env.amqp_channel()
        try:
            for method, properties, body in channel.consume(env.queue, inactivity_timeout=30):
                assert method is not None, f"only {len(outcomes)} of {count} messages arrived"
                outcomes[properties.message_id] = inbox.handle_pika(
                    db, channel, method, properties, body, apply_payment)
                if len(outcomes) == count:
                    break
        finally:
            conn.close()
    return outcomes


@pytest.fixture
def orders(env: Env) -> Iterator[str]:
    """An exchange named as a service would name it (the picture shows it), routed to the
    test's queue; deleted after the test."""
    conn, channel = env.amqp_channel()
    try:
        channel.exchange_declare("orders", exchange_type="topic", durable=False,
                                 auto_delete=True)
        channel.queue_bind(env.queue, "orders", routing_key="#")
        yield "orders"
    finally:
        if conn.is_open:
            channel.exchange_delete("orders")
            conn.close()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def inbox(env: Env, registry: CollectorRegistry) -> Any:
    made = Inbox(f"inbox_{env.gid_prefix}", consumer="billing", metrics=InboxMetrics(registry))
    with env.connect() as db:
        made.migrate(db)
    yield made
    with env.connect() as db:
        db.execute(sql.SQL("DROP TABLE {}, {}").format(
            sql.Identifier(made.table), sql.Identifier(f"{made.table}_keys")))


def test_the_handler_runs_in_the_producer_s_trace(env: Env, inbox: Inbox, orders: str,
                                                  registry: CollectorRegistry,
                                                  spans: InMemorySpanExporter,
                                                  tmp_path: Path) -> None:
    relay_spans = tmp_path / "relay-spans.jsonl"
    relay = env.spawn("devenv.traced_relay", **{SPANS_FILE: str(relay_spans)})
    # The relay is up and polling once it has published an event of no trace.
    with env.connect() as db, db.transaction():
        enqueue(db, exchange=env.exchange, routing_key="warm.up", payload={},
                message_id="warm-up", table=env.table)
    wait_until(lambda: outbox_count(env) == 0, 60, "the relay to publish the first event")
    consume(env, inbox, 1)
    spans.clear()
    relay_spans.unlink()

    # The producer: its own span around its transaction, three events in it.
    with env.connect() as db, tracer().start_as_current_span(
            "checkout", kind=SpanKind.SERVER) as checkout, db.transaction():
        db.execute("SELECT pg_catalog.pg_sleep(0.003)")  # the business change
        enqueue(db, exchange=orders, routing_key="order.paid", payload={"order": 1},
                message_id="paid-1", table=env.table)
        enqueue_many(db, [Event(orders, "order.shipped", {"order": n}, message_id=f"ship-{n}")
                          for n in (1, 2)], table=env.table)
    outcomes = consume(env, inbox, 3)
    assert stop(relay) == 0, log_of(relay)

    assert outcomes == dict.fromkeys(["paid-1", "ship-1", "ship-2"], Outcome.APPLIED)
    finished = spans.get_finished_spans()
    (producer,) = [s for s in finished if s.name == "checkout"]
    processed = [s for s in finished if s.kind is SpanKind.CONSUMER]
    applied = [s for s in finished if s.name == "apply payment"]
    assert len(processed) == len(applied) == 3
    assert producer.context.span_id == checkout.get_span_context().span_id
    for process in processed:
        # The consumer's span: in the producer's trace, its parent the producer's span, as
        # carried by the message (a remote parent).
        assert process.context.trace_id == producer.context.trace_id
        assert process.parent is not None and process.parent.is_remote
        assert process.parent.span_id == producer.context.span_id
        assert process.name == "process orders"
        attributes = dict(process.attributes or {})
        assert attributes["messaging.system"] == "rabbitmq"
        assert attributes["messaging.destination.name"] == "orders"
        assert attributes["outbox_relay.inbox.outcome"] == "applied"
    assert {dict(s.attributes or {})["messaging.message.id"] for s in processed} == {
        "paid-1", "ship-1", "ship-2"}
    # The handler's own spans are children of the consumer's.
    assert {s.parent.span_id for s in applied if s.parent} == {s.context.span_id for s in processed}
    assert {s.context.trace_id for s in applied} == {producer.context.trace_id}

    # The inbox's metrics: four events applied (the warm-up one too), each younger than the
    # test (the AMQP timestamp counts whole seconds: an age is up to a second more).
    labels = {"consumer": "billing"}
    assert registry.get_sample_value("outbox_inbox_messages_total",
                                     {**labels, "outcome": "applied"}) == 4
    assert registry.get_sample_value("outbox_inbox_event_age_seconds_count", labels) == 4
    assert registry.get_sample_value("outbox_inbox_handler_duration_seconds_count", labels) == 4

    # The relay's batch: a span of its own trace, linked to the producer's span (the three
    # events may have gone in one batch or more).
    published = [s for s in read_spans(relay_spans) if s.name == "publish orders"]
    assert published and all(s.kind == "PRODUCER" and s.parent is None for s in published)
    assert {link for s in published for link in s.links} == {
        (producer.context.trace_id, producer.context.span_id)}
    assert sum(s.attributes["messaging.batch.message_count"] for s in published) == 3

    picture = os.environ.get("OUTBOX_TEST_TRACE_PNG")
    if picture:
        trace_picture.draw([*map(trace_picture.from_sdk, finished),
                            *map(trace_picture.from_record, published)], Path(picture))


def test_a_producer_in_another_language_writes_the_traceparent_itself(
        env: Env, inbox: Inbox, spans: InMemorySpanExporter) -> None:
    # Plain INSERTs, as from any language: one with a valid context, one with a malformed one,
    # one with a valid traceparent and a malformed tracestate.
    insert(env, "foreign", headers=Jsonb({"traceparent": FOREIGN_PARENT, "tenant": "a"}))
    insert(env, "garbled", headers=Jsonb({"traceparent": "00-not-a-trace", "tenant": "b"}))
    insert(env, "bad-state", headers=Jsonb({"traceparent": FOREIGN_PARENT,
                                            "tracestate": "NOT VALID"}))
    port = free_port()
    relay = env.spawn("relay", OUTBOX_METRICS_PORT=str(port))
    wait_until(lambda: outbox_count(env) == 0, 60, "the outbox to empty")
    text = scrape(port)
    assert stop(relay) == 0, log_of(relay)

    outcomes = consume(env, inbox, 3)
    assert outcomes == dict.fromkeys(["foreign", "garbled", "bad-state"], Outcome.APPLIED)
    processed = {dict(s.attributes or {})["messaging.message.id"]: s
                 for s in spans.get_finished_spans() if s.kind is SpanKind.CONSUMER}
    foreign = processed["foreign"]
    assert foreign.parent is not None
    assert (f"00-{format_trace_id(foreign.context.trace_id)}-"
            f"{format_span_id(foreign.parent.span_id)}-01") == FOREIGN_PARENT
    # Published without the malformed header (and never dead-lettered): a trace of its own.
    assert processed["garbled"].parent is None
    assert processed["bad-state"].parent is not None
    assert len(processed["bad-state"].context.trace_state) == 0
    for header in ("traceparent", "tracestate"):
        found = re.search(rf'outbox_relay_trace_context_dropped_total{{header="{header}"}} (\S+)',
                          text)
        assert found is not None and float(found.group(1)) == 1.0, text
