"""OpenTelemetry without servers: the producer API records the current span's context with
each event (and keeps one the caller set)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    TraceFlags,
    TraceState,
    set_span_in_context,
)
from opentelemetry.trace import format_span_id as span_hex
from opentelemetry.trace import format_trace_id as trace_hex

from outbox_relay import Event, InvalidEvent, enqueue, enqueue_async, enqueue_many
from outbox_relay.testing import RecordingOutbox
from tests.fix_otel import tracer

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
