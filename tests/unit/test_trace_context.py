"""A row's trace context (headers traceparent, tracestate): the relay publishes a well-formed one
as it is and leaves a malformed one out of the message, which goes without it (never a dead
letter); the producer API refuses a malformed one the caller set, and adds the current span's."""

from __future__ import annotations

import time
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from outbox_relay.model import Message, TracedMessage
from outbox_relay.relay.messages import to_message
from outbox_relay.relay.metrics import RelayMetrics
from outbox_relay.rules import (
    TRACEPARENT_HEADER,
    TRACESTATE_HEADER,
    publish_problem,
    trace_context_problem,
    without_trace_context,
)
from tests.fix_otel import spans
from tests.unit.fakes import Outcome
from tests.unit.relay_rig import Rig, make_rig
from tests.unit.test_messages import row

__all__ = ["spans"]  # the fixture, used by name

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
STATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


@pytest.mark.parametrize("headers", [
    {},
    {"tenant": "a"},
    {TRACEPARENT_HEADER: PARENT},
    {TRACEPARENT_HEADER: PARENT, TRACESTATE_HEADER: STATE},
    {TRACEPARENT_HEADER: PARENT.replace("-01", "-00")},  # not sampled: still carried
    # A later version may add fields after a dash.
    {TRACEPARENT_HEADER: "cc-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-what-ever"},
    {TRACEPARENT_HEADER: PARENT, TRACESTATE_HEADER: ""},  # empty members are allowed
    {TRACEPARENT_HEADER: PARENT, TRACESTATE_HEADER: " a=1 ,, b@vendor=x y "},
    {TRACEPARENT_HEADER: PARENT, TRACESTATE_HEADER: ",".join(f"k{n}=v" for n in range(32))},
])
def test_well_formed_trace_contexts_pass(headers: dict[str, Any]) -> None:
    assert trace_context_problem(headers) is None


@pytest.mark.parametrize(("headers", "header", "why"), [
    ({TRACEPARENT_HEADER: "garbage"}, "traceparent", "not version-traceid-parentid-flags"),
    ({TRACEPARENT_HEADER: PARENT.upper()}, "traceparent", "lowercase hex"),
    ({TRACEPARENT_HEADER: " " + PARENT}, "traceparent", "lowercase hex"),
    ({TRACEPARENT_HEADER: PARENT[:-1]}, "traceparent", "lowercase hex"),
    ({TRACEPARENT_HEADER: PARENT + "-more"}, "traceparent", "not valid for version 00"),
    ({TRACEPARENT_HEADER: "ff" + PARENT[2:]}, "traceparent", "not valid for version ff"),
    ({TRACEPARENT_HEADER: f"00-{'0' * 32}-b7ad6b7169203331-01"}, "traceparent", "all-zero"),
    ({TRACEPARENT_HEADER: f"00-0af7651916cd43dd8448eb211c80319c-{'0' * 16}-01"}, "traceparent",
     "all-zero"),
    ({TRACEPARENT_HEADER: 42}, "traceparent", "not a string but int"),
    ({TRACEPARENT_HEADER: None}, "traceparent", "not a string but NoneType"),
    ({TRACEPARENT_HEADER: "cc" + PARENT[2:] + "-" + "x" * 500}, "traceparent", "longer than 512"),
    ({TRACEPARENT_HEADER: "garbage", TRACESTATE_HEADER: STATE}, "traceparent", "lowercase hex"),
    ({TRACESTATE_HEADER: STATE}, "tracestate", "without a traceparent"),
    ({TRACEPARENT_HEADER: PARENT, TRACESTATE_HEADER: "no equals sign"}, "tracestate",
     "not key=value"),
    ({TRACEPARENT_HEADER: PARENT, TRACESTATE_HEADER: "UPPER=1"}, "tracestate", "not key=value"),
    ({TRACEPARENT_HEADER: PARENT, TRACESTATE_HEADER: "a=1,=2"}, "tracestate", "not key=value"),
    ({TRACEPARENT_HEADER: PARENT, TRACESTATE_HEADER: ",".join(f"k{n}=v" for n in range(33))},
     "tracestate", "more than 32 members"),
    ({TRACEPARENT_HEADER: PARENT, TRACESTATE_HEADER: "a=" + "x" * 9000}, "tracestate",
     "longer than 8192"),
    ({TRACEPARENT_HEADER: PARENT, TRACESTATE_HEADER: ["a=1"]}, "tracestate", "not a string"),
])
def test_malformed_trace_contexts_are_named(headers: dict[str, Any], header: str,
                                            why: str) -> None:
    found = trace_context_problem(headers)
    assert found is not None and found.field == header
    assert f"header {header} " in found.reason and why in found.reason


def test_what_is_left_out_with_each_malformed_header() -> None:
    bad_parent = {"tenant": "a", TRACEPARENT_HEADER: "garbage", TRACESTATE_HEADER: STATE}
    found = trace_context_problem(bad_parent)
    assert found is not None
    assert without_trace_context(bad_parent, found) == {"tenant": "a"}
    bad_state = {"tenant": "a", TRACEPARENT_HEADER: PARENT, TRACESTATE_HEADER: "x"}
    found = trace_context_problem(bad_state)
    assert found is not None
    assert without_trace_context(bad_state, found) == {"tenant": "a", TRACEPARENT_HEADER: PARENT}


def published_headers(built: Any) -> dict[str, Any]:
    assert isinstance(built, Message), built
    return dict(built.properties.headers or {})


def test_the_relay_publishes_a_trace_context_as_the_row_carries_it() -> None:
    headers = {TRACEPARENT_HEADER: PARENT, TRACESTATE_HEADER: STATE, "tenant": "a"}
    built = to_message(row(headers=headers, ordering_key=None), max_bytes=1000)
    assert published_headers(built) == headers
    assert isinstance(built, TracedMessage)
    assert (built.traceparent, built.trace_dropped) == (PARENT, None)


@pytest.mark.parametrize(("headers", "kept", "dropped"), [
    ({TRACEPARENT_HEADER: "00-nope", TRACESTATE_HEADER: STATE, "tenant": "a"},
     {"tenant": "a"}, "traceparent"),
    ({TRACEPARENT_HEADER: PARENT, TRACESTATE_HEADER: "=", "tenant": "a"},
     {TRACEPARENT_HEADER: PARENT, "tenant": "a"}, "tracestate"),
    ({TRACESTATE_HEADER: STATE}, {}, "tracestate"),
    ({TRACEPARENT_HEADER: {"nested": [1, 2]}}, {}, "traceparent"),
])
def test_the_relay_publishes_the_event_without_a_malformed_trace_context(
        headers: dict[str, Any], kept: dict[str, Any], dropped: str) -> None:
    built = to_message(row(headers=headers, ordering_key=None), max_bytes=1000)
    assert published_headers(built) == kept
    assert isinstance(built, TracedMessage) and built.trace_dropped == dropped
    assert built.traceparent == kept.get(TRACEPARENT_HEADER)
    # A keyed row gets the relay's order headers as usual.
    keyed = to_message(row(headers=headers), max_bytes=1000)
    assert {"x-ordering-key", "x-outbox-id"} <= set(published_headers(keyed))


def test_rows_without_a_trace_context_are_untouched() -> None:
    for headers in ({}, {"tenant": "a"}):
        built = to_message(row(headers=headers), max_bytes=1000)
        assert type(built) is Message


def test_a_malformed_trace_context_is_no_reason_to_dead_letter() -> None:
    assert publish_problem(message_id="m", exchange="e", routing_key="r", body_size=2,
                           headers={TRACEPARENT_HEADER: "garbage"},
                           max_message_bytes=100) is None


def test_the_relay_declares_the_counter_by_header() -> None:
    metrics = RelayMetrics()
    for header in ("traceparent", "tracestate"):
        assert metrics.registry.get_sample_value(
            "outbox_relay_trace_context_dropped_total", {"header": header}) == 0


# -- the relay loop (on the fakes) --------------------------------------------------------------


def test_a_batch_with_a_malformed_trace_context_is_published_whole_and_counted(rig: Rig) -> None:
    plain = rig.store.add()
    traced = rig.store.add(headers={TRACEPARENT_HEADER: PARENT, TRACESTATE_HEADER: STATE})
    bad_parent = rig.store.add(headers={TRACEPARENT_HEADER: "x", TRACESTATE_HEADER: STATE})
    bad_state = rig.store.add(headers={TRACEPARENT_HEADER: PARENT, TRACESTATE_HEADER: "?"})

    rig.relay.run_batch()

    assert rig.publisher.published_ids() == [plain, traced, bad_parent, bad_state]
    assert rig.store.dead_letter == {}
    assert rig.batches("committed") == 1
    assert rig.metric("outbox_relay_trace_context_dropped_total", header="traceparent") == 1
    assert rig.metric("outbox_relay_trace_context_dropped_total", header="tracestate") == 1


def test_a_rolled_back_batch_counts_no_dropped_trace_context(rig: Rig) -> None:
    bad = rig.store.add(headers={TRACEPARENT_HEADER: "x"})
    rig.publisher.script(bad, Outcome.RETURN, times=1)

    rig.step()
    assert rig.metric("outbox_relay_trace_context_dropped_total", header="traceparent") == 0
    rig.step()  # published this time: counted once
    assert rig.metric("outbox_relay_trace_context_dropped_total", header="traceparent") == 1


@pytest.mark.parametrize("tracestate", [
    ("a=" + " " * 250 + "b" + " " * 5 + ",") * 30 + "\x00",
    ("a=b" + " " * 250 + ",") * 30 + "A",
    (" " * 100 + ",") * 80 + "A",
    (" \t" * 50 + ",") * 80 + "A",
    "," * 8191 + "A",
    " " * 8191 + "A",
    ("a=" + "x " * 127 + "y" + ",") * 31 + "A",
    ("a0" * 120 + "@b=c ") * 30 + "!",
])
def test_no_tracestate_holds_the_relay_up(tracestate: str) -> None:
    """A producer writes any text: the check's time grows with its length, never more (a
    pattern that could match blanks two ways took minutes on the third of these)."""
    started = time.perf_counter()
    found = trace_context_problem({TRACEPARENT_HEADER: PARENT, TRACESTATE_HEADER: tracestate[:8192]})
    assert found is not None and found.field == "tracestate"
    assert time.perf_counter() - started < 0.5  # about 2 ms at worst, measured


# -- the relay's publish span (OpenTelemetry's SDK set up in this process) ----------------------


def test_a_traced_relay_publishes_a_batch_in_a_span_linked_to_its_events(
        rig: Rig, spans: InMemorySpanExporter) -> None:
    other = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    rig.store.add(headers={TRACEPARENT_HEADER: PARENT, TRACESTATE_HEADER: STATE})
    rig.store.add()
    rig.store.add(headers={TRACEPARENT_HEADER: other})
    rig.store.add(headers={TRACEPARENT_HEADER: "dropped"})

    rig.relay.run_batch()

    (publish,) = spans.get_finished_spans()
    assert publish.name == "publish events" and publish.kind is SpanKind.PRODUCER
    assert publish.parent is None  # the relay's own trace; the events' are links away
    assert [(f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}",
             int(link.context.trace_flags)) for link in publish.links] == [
        ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", 1),
        ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", 0)]
    attributes = dict(publish.attributes or {})
    assert attributes.pop("outbox_relay.gid").startswith(rig.relay.settings.gid_prefix)
    assert attributes == {
        "messaging.system": "rabbitmq", "messaging.operation.name": "publish",
        "messaging.operation.type": "send", "messaging.batch.message_count": 4,
        "messaging.destination.name": "events", "outbox_relay.confirmed_count": 4}
    assert publish.status.status_code is StatusCode.UNSET


def test_a_refused_batch_s_span_is_an_error(rig: Rig, spans: InMemorySpanExporter) -> None:
    refused = rig.store.add(headers={TRACEPARENT_HEADER: PARENT})
    rig.store.add(exchange="other")
    rig.publisher.script(refused, Outcome.RETURN, times=1)

    rig.relay.run_batch()

    (publish,) = spans.get_finished_spans()
    assert publish.name == "publish"  # two exchanges
    assert "messaging.destination.name" not in (publish.attributes or {})
    assert publish.status.status_code is StatusCode.ERROR
    assert (publish.attributes or {})["error.type"] == "unroutable"


def test_a_batch_s_span_gets_no_more_links_than_the_sdk_keeps(
        monkeypatch: pytest.MonkeyPatch, spans: InMemorySpanExporter) -> None:
    rig = make_rig(monkeypatch, batch_size=130)
    for n in range(130):
        rig.store.add(headers={TRACEPARENT_HEADER: f"00-{n + 1:032x}-{n + 1:016x}-01"})

    rig.relay.run_batch()

    (publish,) = spans.get_finished_spans()
    assert (publish.attributes or {})["messaging.batch.message_count"] == 130
    # The first 128 (OTEL_SPAN_LINK_COUNT_LIMIT's default): the SDK would drop the others.
    assert [link.context.span_id for link in publish.links] == list(range(1, 129))


@pytest.mark.parametrize(("text", "limit"), [("", 128), ("5", 5), ("0", 0), ("-1", 0),
                                             ("many", 128)])
def test_the_link_limit_is_the_sdk_s_setting(text: str, limit: int) -> None:
    from outbox_relay.tracing import _link_limit

    assert _link_limit(text) == limit
