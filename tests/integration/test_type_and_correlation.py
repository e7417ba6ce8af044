"""The AMQP type and correlation_id of an event, against real servers (issue 34): written by
enqueue, enqueue_many, enqueue_async and the SQL API's statement, published by the relay CLI,
read by a consumer through InboxMessage; kept by the dead-letter table and by requeue; and a
version 2 schema upgraded by `migrate` to carry them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from typing import Any

import pika
import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from devenv import checker
from outbox_relay import Event, InboxMessage, enqueue, enqueue_async, enqueue_many
from outbox_relay.schema import SCHEMA_VERSION, migrate, schema_version
from outbox_relay.sql import api_queries
from outbox_relay.tables import Tables
from tests.conftest import ROOT, Env
from tests.integration.test_pipeline import log_of, outbox_count, stop, wait_until

CORRELATION = uuid.UUID("2d1f6c0a-5b7e-4f3a-8c9d-0e1f2a3b4c5d")


def relay_until_empty(env: Env, what: str) -> None:
    relay = env.spawn("relay")
    try:
        wait_until(lambda: outbox_count(env) == 0, 60, what)
    finally:
        assert stop(relay) == 0, log_of(relay)


def consume(env: Env, count: int) -> dict[str, InboxMessage]:
    """``count`` messages from the test's queue, as the inbox's pika helper reads them."""
    connection = pika.BlockingConnection(pika.URLParameters(env.amqp_url))
    try:
        channel = connection.channel()
        received: dict[str, InboxMessage] = {}
        for _ in range(count):
            method, properties, body = channel.basic_get(env.queue, auto_ack=True)
            assert method is not None, f"only {len(received)} of {count} messages arrived"
            message = InboxMessage.from_pika(method, properties, body)
            received[message.message_id] = message
        method, _, _ = channel.basic_get(env.queue, auto_ack=True)
        assert method is None, "more messages than expected"
    finally:
        connection.close()
    return received


def cli(env: Env, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "outbox_relay.relay", *args], env=env.cli_env(),
                          capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)


def test_every_producer_path_reaches_the_consumer_with_both_properties(env: Env) -> None:
    with psycopg.connect(env.db_url) as conn:
        one = enqueue(conn, exchange=env.exchange, routing_key="order.paid", payload={"n": 1},
                      message_type="order.paid.v1", correlation_id=CORRELATION,
                      table=env.table)
        many = enqueue_many(conn, [
            Event(env.exchange, "order.shipped", {"n": 2}, message_type="order.shipped.v1",
                  correlation_id="req-2", ordering_key="order-2"),
            Event(env.exchange, "order.noted", {"n": 3}),  # sets neither
        ], table=env.table)
        # The SQL API's statement (sql/api.sql), as a producer in another language runs it.
        conn.execute(Tables(env.table).compose(api_queries()["enqueue"]), {
            "message_id": ["sql-1"], "exchange": [env.exchange], "routing_key": ["order.sql"],
            "ordering_key": [None], "payload": ['{"n": 4}'], "payload_bytes": [None],
            "headers": ["{}"], "content_type": [None], "message_type": ["order.sql.v1"],
            "correlation_id": ["ключ-€"], "available_at": [None]})
        conn.commit()

    async def produce_async() -> str:
        async with await psycopg.AsyncConnection.connect(env.db_url) as conn:
            message_id = await enqueue_async(
                conn, exchange=env.exchange, routing_key="order.async", payload={"n": 5},
                message_type="order.async.v1", table=env.table)
            await conn.commit()
            return message_id

    late = asyncio.run(produce_async())
    relay_until_empty(env, "the relay to empty the outbox")

    received = consume(env, 5)
    seen = {message_id: (m.message_type, m.correlation_id) for message_id, m in received.items()}
    assert seen == {one: ("order.paid.v1", str(CORRELATION)),
                    many[0]: ("order.shipped.v1", "req-2"), many[1]: (None, None),
                    "sql-1": ("order.sql.v1", "ключ-€"), late: ("order.async.v1", None)}
    assert received[many[0]].ordering_key == "order-2"  # the relay's headers still come


def insert_row(env: Env, message_id: str, **columns: Any) -> None:
    values = {"message_id": message_id, "exchange": env.exchange, "routing_key": "hostile",
              "payload": Jsonb({"id": message_id}), **columns}
    names = sql.SQL(", ").join(sql.Identifier(c) for c in values)
    with env.connect() as conn:
        conn.execute(sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
            Tables(env.table).outbox, names,
            sql.SQL(", ").join(sql.Placeholder() for _ in values)), list(values.values()))


def test_dead_letters_and_requeue_keep_both(env: Env) -> None:
    """A row dead-lettered for another reason keeps its type and correlation id there; fixed and
    requeued by an operator, it goes out with them."""
    insert_row(env, "misrouted", routing_key="r" * 300, message_type="order.paid.v1",
               correlation_id=str(CORRELATION))
    relay_until_empty(env, "the row to be dead-lettered")
    tables = Tables(env.table)
    with env.connect() as conn:
        [(dead_id, kind, correlation, reason)] = conn.execute(sql.SQL(
            "SELECT id, message_type, correlation_id, last_error FROM {}").format(
            tables.dead_letter)).fetchall()
        assert (kind, correlation) == ("order.paid.v1", str(CORRELATION))
        assert reason == "routing_key is longer than 255 bytes"
        conn.execute(sql.SQL("UPDATE {} SET routing_key = 'order.paid'").format(
            tables.dead_letter))
    requeued = cli(env, "dead-letter", "requeue", "--id", str(dead_id))
    assert requeued.returncode == 0 and "requeued 1 dead letter" in requeued.stdout, requeued
    relay_until_empty(env, "the requeued row to go out")
    message = consume(env, 1)["misrouted"]
    assert (message.message_type, message.correlation_id) == ("order.paid.v1", str(CORRELATION))


# The outbox of schema version 2 (before the AMQP type and correlation_id): made from today's
# by taking the columns out, row_bytes as version 2 computed it, and version 2's comment.
TO_VERSION_2 = """
ALTER TABLE {outbox} DROP COLUMN row_bytes;
ALTER TABLE {outbox} DROP COLUMN message_type, DROP COLUMN correlation_id;
ALTER TABLE {dead_letter} DROP COLUMN message_type, DROP COLUMN correlation_id;
ALTER TABLE {outbox} ADD COLUMN row_bytes bigint GENERATED ALWAYS AS (
    coalesce(octet_length(payload_bytes), octet_length(payload::text), 0)::bigint
    + octet_length(headers::text) + octet_length(message_id) + octet_length(exchange)
    + octet_length(routing_key) + coalesce(octet_length(ordering_key), 0)
    + coalesce(octet_length(content_type), 0)) STORED;
COMMENT ON TABLE {outbox} IS 'outbox-relay schema version 2, usable by programs of schema '
    'version 2 or newer; written by outbox-relay migrate';
"""


def test_a_version_2_schema_is_upgraded_in_place(env: Env) -> None:
    tables = Tables(env.table)
    with env.connect() as conn:
        conn.execute(tables.compose(TO_VERSION_2))
        produced = checker.insert_events(conn, env.table, 30, exchange=env.exchange,
                                         routing_key=env.routing_key)
        conn.execute(sql.SQL(
            "INSERT INTO {} (message_id, exchange, routing_key, headers, payload, created_at,"
            " attempts, last_error) VALUES ('old-dead', %s, %s, '{{}}', '{{}}', now(), 3, 'x')"
        ).format(tables.dead_letter), (env.exchange, env.routing_key))
        before = dict(conn.execute(sql.SQL("SELECT message_id, row_bytes FROM {}").format(
            tables.outbox)).fetchall())
    checked = cli(env, "migrate", "--check")
    assert checked.returncode == 3
    assert (f"has schema version 2, this outbox-relay needs version {SCHEMA_VERSION}: run "
            "`outbox-relay migrate`") in checked.stderr

    migrate(env.db_url, env.table)
    migrate(env.db_url, env.table)  # idempotent: row_bytes is not dropped again
    with env.connect() as conn:
        found = schema_version(conn, tables)
        assert (found.version, found.problem) == (SCHEMA_VERSION, None)
        after = dict(conn.execute(sql.SQL("SELECT message_id, row_bytes FROM {}").format(
            tables.outbox)).fetchall())
        assert after == before  # recomputed for the rows there: the new columns are NULL
        expression = conn.execute(
            "SELECT pg_get_expr(d.adbin, d.adrelid) FROM pg_attrdef d JOIN pg_attribute a"
            " ON a.attrelid = d.adrelid AND a.attnum = d.adnum"
            " WHERE d.adrelid = %s::regclass AND a.attname = 'row_bytes'",
            (tables.outbox.as_string(None),)).fetchone()
        assert expression is not None and "correlation_id" in expression[0]
    with psycopg.connect(env.db_url) as conn:
        new = enqueue(conn, exchange=env.exchange, routing_key=env.routing_key,
                      payload={"n": 1}, message_type="t" * 200, correlation_id="c" * 250,
                      table=env.table)
        conn.commit()
    with env.connect() as conn:
        row = conn.execute(sql.SQL("SELECT row_bytes FROM {} WHERE message_id = %s").format(
            tables.outbox), (new,)).fetchone()
        # Both columns are counted in what the relay fetches of the row.
        assert row is not None and row[0] >= 450
    relay_until_empty(env, "the relay to run on the upgraded schema")
    listed = cli(env, "dead-letter", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    [old] = json.loads(listed.stdout)
    requeued = cli(env, "dead-letter", "requeue", "--id", str(old["id"]))
    assert requeued.returncode == 0, requeued.stderr
    relay_until_empty(env, "the version 2 dead letter to go out")
    report = env.drain_and_check([*produced, new, "old-dead"])
    assert report.ok(), report.summary()
