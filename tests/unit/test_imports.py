"""``import outbox_relay`` loads the services' library only: no module of either program, not
their runtime, no pika, no optional integration. A web service imports it just to call
``enqueue``; each program loads what it needs when it starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

# What a service's process must not load by importing the library: the programs, what only
# the programs run on, the broker client, and the optional integrations.
NOT_FOR_SERVICES = ("outbox_relay.relay", "outbox_relay.resolver", "outbox_relay.runtime",
                    "outbox_relay.rabbitmq", "outbox_relay.pika_private", "pika", "tenacity",
                    "prometheus_client", "sqlalchemy", "aio_pika", "django", "alembic",
                    "opentelemetry", "outbox_relay.inbox_metrics")


def loaded_after(statement: str) -> list[str]:
    code = f"import sys; {statement}; import json; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    modules: list[str] = json.loads(done.stdout)
    return modules


def of(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes)]


def test_the_library_loads_no_program_and_no_pika() -> None:
    modules = loaded_after("import outbox_relay")
    assert of(modules, NOT_FOR_SERVICES) == []
    # Nor a bare ``relay`` or ``resolver``: the programs have one name, under outbox_relay.
    assert of(modules, ("relay", "resolver", "sql")) == []


# The test double in use, sync and async.
RECORDING = ("import asyncio; from outbox_relay.testing import RecordingOutbox; "
             "from outbox_relay import enqueue, enqueue_async; o = RecordingOutbox(); "
             "enqueue(o, exchange='e', routing_key='r', payload={'a': 1}); "
             "asyncio.run(enqueue_async(o, exchange='e', routing_key='r', payload=2)); "
             "o.commit(); assert len(o.find(routing_key='r')) == 2")


@pytest.mark.parametrize("statement", [
    # The producer's checks with a plain and a keyed event: the header table is encoded by
    # struct (outbox_relay.properties), pika is not needed to measure it.
    "from outbox_relay.rules import publish_problem; "
    "publish_problem(message_id='m', exchange='e', routing_key='r', body_size=10, "
    "headers={'tenant': 'a'}, ordering_key='k', max_message_bytes=100)",
    "from outbox_relay import schema_sql, inbox_schema_sql; schema_sql(); inbox_schema_sql()",
    "from outbox_relay import Inbox; Inbox('inbox', consumer='billing')",
    # Alembic's filter and the schema's helpers import neither Alembic nor SQLAlchemy.
    "from outbox_relay.alembic import include_object; "
    "from outbox_relay.schema import drop_schema_sql, roles_sql; drop_schema_sql('o'); roles_sql()",
    RECORDING,
])
def test_using_the_library_loads_no_program(statement: str) -> None:
    assert of(loaded_after(f"import outbox_relay; {statement}"), NOT_FOR_SERVICES) == []


def test_the_test_double_loads_nothing_the_library_does_not() -> None:
    """A service's unit tests import outbox_relay.testing: no pika, no more of psycopg than the
    library's own import, no program, nothing but the module itself (compared with the library
    once it has read its INSERT statement, and asyncio)."""
    library = set(loaded_after("import asyncio, outbox_relay.producer; "
                               "outbox_relay.producer._statement('outbox')"))
    assert sorted(set(loaded_after(f"import outbox_relay; {RECORDING}")) - library) == [
        "outbox_relay.testing"]


def test_a_header_table_of_another_shape_is_measured_by_pika() -> None:
    """Only a table struct does not encode (nested, floats) loads pika's encoder to measure it."""
    modules = loaded_after(
        "from outbox_relay.rules import publish_problem; "
        "publish_problem(message_id='m', exchange='e', routing_key='r', body_size=10, "
        "headers={'nested': {'price': 1.5}}, max_message_bytes=100)")
    assert "pika" in modules
    assert of(modules, ("outbox_relay.relay", "outbox_relay.resolver", "outbox_relay.runtime")) == []


@pytest.mark.parametrize("program", ["outbox_relay.relay.cli", "outbox_relay.resolver.cli"])
def test_each_program_loads_the_other_not(program: str) -> None:
    other = "outbox_relay.resolver" if "relay.cli" in program else "outbox_relay.relay"
    modules = loaded_after(f"import {program}")
    assert of(modules, (other,)) == []
    assert of(modules, ("relay", "resolver", "sql")) == []


# A consumer's inbox at work through its pika helper, on stand-ins for the connection and
# the channel (the SQL is not what is looked at here).
INBOX_AT_WORK = (
    "from types import SimpleNamespace as NS; from contextlib import nullcontext; "
    "from psycopg.pq import TransactionStatus; from outbox_relay import Inbox, Outcome; "
    "inbox = Inbox('inbox', consumer='billing'); inbox.record = lambda c, m: Outcome.APPLIED; "
    "conn = NS(closed=False, broken=False, transaction=nullcontext, "
    "info=NS(transaction_status=TransactionStatus.IDLE)); "
    "channel = NS(basic_ack=lambda tag: None, basic_nack=lambda tag, requeue: None); "
    "props = NS(message_id='m', headers={'traceparent': "
    "'00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'}, content_type=None, "
    "user_id=None, timestamp=1700000000, type=None, correlation_id=None); "
    "method = NS(delivery_tag=1, routing_key='r', exchange='e', redelivered=False); "
    "assert inbox.handle_pika(conn, channel, method, props, b'{}', lambda c, m: None) "
    "is Outcome.APPLIED")


@pytest.mark.parametrize("statement", [RECORDING, INBOX_AT_WORK])
def test_opentelemetry_installed_but_unused_is_not_loaded(statement: str) -> None:
    """The extra otel installed, in a service that does not use OpenTelemetry: producing and
    consuming load none of it (outbox_relay.tracing asks sys.modules first)."""
    assert of(loaded_after(f"import outbox_relay; {statement}"), ("opentelemetry",)) == []


@pytest.mark.parametrize("statement", [RECORDING, INBOX_AT_WORK])
def test_the_library_works_without_opentelemetry(statement: str) -> None:
    """The extra otel absent (importing opentelemetry fails): producing and consuming work."""
    modules = loaded_after("sys.modules['opentelemetry'] = None; import outbox_relay; "
                           + statement)
    assert "outbox_relay.tracing" in modules  # the glue itself is always there, and harmless


def test_inbox_metrics_load_prometheus_client_only_when_asked() -> None:
    modules = loaded_after("import outbox_relay; from outbox_relay.inbox_metrics import "
                           "InboxMetrics; outbox_relay.Inbox(consumer='b', metrics=InboxMetrics())")
    assert "prometheus_client" in modules
    assert of(modules, ("outbox_relay.relay", "outbox_relay.resolver", "outbox_relay.runtime",
                        "pika", "opentelemetry")) == []


def test_a_service_using_opentelemetry_gets_the_trace_context_loaded() -> None:
    """The other side of the rule: with a span active, enqueue loads OpenTelemetry's API (the
    propagator), no SDK."""
    modules = loaded_after(
        "from opentelemetry import trace; from opentelemetry.trace import NonRecordingSpan, "
        "SpanContext; from outbox_relay.testing import RecordingOutbox; "
        "from outbox_relay import enqueue; o = RecordingOutbox(); "
        "span = NonRecordingSpan(SpanContext(1, 2, is_remote=False)); "
        "ctx = trace.use_span(span); ctx.__enter__(); "
        "enqueue(o, exchange='e', routing_key='r', payload=1); o.commit(); "
        "assert o.events[0].headers['traceparent'].startswith('00-'), o.events[0].headers")
    assert "opentelemetry.trace.propagation.tracecontext" in modules
    assert of(modules, ("opentelemetry.sdk",)) == []
