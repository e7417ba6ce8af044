"""The producer API against the real PostgreSQL (and, at the end, the real relay and RabbitMQ):
psycopg 3 connections and cursors (sync and async), SQLAlchemy Session and Connection (sync and
async), the Django recipe of the README. The event commits and rolls back with the caller's
own change; nothing is ever committed by the API."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit

import pika
import psycopg
import pytest
import sqlalchemy as sa
from psycopg import sql
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import outbox_relay
from outbox_relay import (
    Event,
    InboxMessage,
    InvalidEvent,
    NotInTransaction,
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
)
from outbox_relay.tables import Tables
from outbox_relay.testing import RecordingOutbox
from tests.conftest import ROOT, Env
from tests.integration.test_pipeline import log_of, outbox_count, stop, wait_until

COLUMNS = ("message_id, exchange, routing_key, ordering_key, payload, payload_bytes, headers, "
           "content_type, available_at, created_at")


def rows(env: Env) -> list[dict[str, Any]]:
    with env.connect() as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute(sql.SQL("SELECT {} FROM {} ORDER BY id").format(
            sql.SQL(COLUMNS), Tables(env.table).outbox))
        return cur.fetchall()


@pytest.fixture
def notes(env: Env) -> Iterator[str]:
    """A business table of the test's own, changed in the same transactions as the events."""
    name = f"notes_{env.gid_prefix}"
    with env.connect() as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (note text)").format(sql.Identifier(name)))
    yield name
    with env.connect() as conn:
        conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(name)))


def note_count(env: Env, notes: str) -> int:
    with env.connect() as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(notes)))
        return int(row.fetchone()[0])  # type: ignore[index]


def sqlalchemy_url(env: Env) -> str:
    return env.db_url.replace("postgresql://", "postgresql+psycopg://", 1)


# -- psycopg ----------------------------------------------------------------------------------


def test_psycopg_the_event_commits_and_rolls_back_with_the_callers_change(
        env: Env, notes: str) -> None:
    insert_note = sql.SQL("INSERT INTO {} VALUES ('paid')").format(sql.Identifier(notes))
    with psycopg.connect(env.db_url) as conn:
        conn.execute(insert_note)
        kept = enqueue(conn, exchange=env.exchange, routing_key="order.paid",
                       payload={"order_id": 42, "amount": "19.90"}, ordering_key="order-42",
                       headers={"tenant": "acme", "version": 2}, table=env.table)
        assert outbox_count(env) == 0  # not committed by the API
        conn.commit()
        conn.execute(insert_note)
        enqueue(conn, exchange=env.exchange, routing_key="order.paid", payload={"x": 1},
                table=env.table)
        conn.rollback()

    assert note_count(env, notes) == 1
    [row] = rows(env)
    assert row["message_id"] == kept
    assert (row["exchange"], row["routing_key"], row["ordering_key"]) == (
        env.exchange, "order.paid", "order-42")
    assert row["payload"] == {"order_id": 42, "amount": "19.90"} and row["payload_bytes"] is None
    assert row["headers"] == {"tenant": "acme", "version": 2}
    assert row["content_type"] is None
    assert abs((row["available_at"] - row["created_at"]).total_seconds()) < 1  # the default


def test_psycopg_autocommit_connection_needs_a_transaction_block(env: Env) -> None:
    with psycopg.connect(env.db_url, autocommit=True) as conn:
        with pytest.raises(NotInTransaction, match=r"conn\.transaction"):
            enqueue(conn, exchange="", routing_key="q", payload=1, table=env.table)
        with conn.transaction():
            enqueue(conn, exchange="", routing_key="q", payload=1, table=env.table)
    assert outbox_count(env) == 1


def test_psycopg_a_refused_event_leaves_the_transaction_usable(env: Env, notes: str) -> None:
    with psycopg.connect(env.db_url) as conn:
        conn.execute(sql.SQL("INSERT INTO {} VALUES ('kept')").format(sql.Identifier(notes)))
        with pytest.raises(InvalidEvent):
            enqueue(conn, exchange="", routing_key="r" * 256, payload=1, table=env.table)
        conn.commit()  # would fail had a statement of the transaction failed
    assert note_count(env, notes) == 1 and outbox_count(env) == 0


def test_psycopg_cursor_keeps_its_own_results(env: Env) -> None:
    with psycopg.connect(env.db_url) as conn, conn.cursor() as cur:
        cur.execute("SELECT generate_series(1, 3)")
        ids = enqueue_many(cur, [Event("", "q", n) for n in range(3)], table=env.table)
        assert cur.fetchall() == [(1,), (2,), (3,)]
        conn.commit()
    assert [r["message_id"] for r in rows(env)] == ids


def test_psycopg_batch_gets_ids_in_the_given_order_with_every_kind_of_value(env: Env) -> None:
    at = datetime.now(timezone.utc) + timedelta(hours=1)
    events = [
        Event(env.exchange, "a", {"n": 0}, ordering_key="k"),
        Event(env.exchange, "b", b"\x00\xffraw", content_type="text/plain"),
        Event(env.exchange, "c", "a JSON string", message_id="chosen-id"),
        Event(env.exchange, "d", [1, 2.5, None], available_at=at, headers={"h": [1, {"x": 1.5}]}),
        *(Event(env.exchange, "e", {"n": n}, ordering_key="k") for n in range(1, 1000)),
    ]
    with psycopg.connect(env.db_url) as conn:
        ids = enqueue_many(conn, events, table=env.table)
        conn.commit()
    got = rows(env)
    assert [r["message_id"] for r in got] == ids and ids[2] == "chosen-id"
    assert got[1]["payload_bytes"] == b"\x00\xffraw" and got[1]["payload"] is None
    assert got[1]["content_type"] == "text/plain"
    assert got[2]["payload"] == "a JSON string"
    assert got[3]["available_at"] == at and got[3]["headers"] == {"h": [1, {"x": 1.5}]}
    assert [r["payload"]["n"] for r in got if r["ordering_key"] == "k"] == list(range(1000))


def test_psycopg_async_connection_and_cursor(env: Env) -> None:
    async def main() -> tuple[str, list[str]]:
        async with await psycopg.AsyncConnection.connect(env.db_url) as conn:
            one = await enqueue_async(conn, exchange="", routing_key="q", payload={"a": 1},
                                      table=env.table)
            async with conn.cursor() as cur:
                many = await enqueue_many_async(cur, [Event("", "q", 2), Event("", "q", b"3")],
                                                table=env.table)
            await conn.commit()
        async with await psycopg.AsyncConnection.connect(env.db_url, autocommit=True) as conn:
            with pytest.raises(NotInTransaction):
                await enqueue_async(conn, exchange="", routing_key="q", payload=1,
                                    table=env.table)
        return one, many

    one, many = asyncio.run(main())
    assert [r["message_id"] for r in rows(env)] == [one, *many]


def test_psycopg_async_a_forgotten_await_is_never_a_silent_loss(
        env: Env, notes: str, caplog: pytest.LogCaptureFixture) -> None:
    """The sync name on an async connection raises at once: the caller's transaction rolls
    back, its change with it. The async name without await writes nothing and says so at the
    line that dropped it, before the transaction commits."""
    insert_note = sql.SQL("INSERT INTO {} VALUES ('paid')").format(sql.Identifier(notes))

    async def main() -> tuple[int, int]:
        async with await psycopg.AsyncConnection.connect(env.db_url) as conn:
            with pytest.raises(TypeError, match="await enqueue_async"):
                async with conn.transaction():
                    await conn.execute(insert_note)
                    enqueue(conn, exchange="", routing_key="q", payload=1,  # type: ignore[arg-type]
                            table=env.table)
            with pytest.warns(RuntimeWarning, match="never awaited"):
                async with conn.transaction():
                    await conn.execute(insert_note)
                    enqueue_async(conn, exchange="", routing_key="q", payload=2,
                                  message_id="dropped", table=env.table)
                    reported_before_commit = len(caplog.records)
            await conn.commit()
        return reported_before_commit, len(caplog.records)

    reported_before_commit, reported = asyncio.run(main())
    assert reported_before_commit == reported == 1
    assert "message id dropped" in caplog.records[0].getMessage()
    assert caplog.records[0].levelname == "ERROR"
    # The first transaction rolled back whole; the second committed its change without the
    # event it dropped (what the report is for): nothing else was written.
    assert note_count(env, notes) == 1 and outbox_count(env) == 0


# -- SQLAlchemy -------------------------------------------------------------------------------


def test_sqlalchemy_session_and_connection(env: Env, notes: str) -> None:
    engine = sa.create_engine(sqlalchemy_url(env))
    statements: list[str] = []
    sa.event.listen(engine, "before_cursor_execute",
                    lambda *args: statements.append(args[2]))
    try:
        with Session(engine) as session:
            session.execute(sa.text(f"INSERT INTO {notes} VALUES ('session')"))
            first = enqueue(session, exchange="", routing_key="q", payload={"via": "session"},
                            table=env.table)
            session.commit()
        with Session(engine) as session:
            enqueue(session, exchange="", routing_key="q", payload={"via": "rolled back"},
                    table=env.table)
            session.rollback()
        statements.clear()
        with engine.begin() as connection:
            many = enqueue_many(connection, [Event("", "q", {"via": "connection", "n": n},
                                                   headers={"n": n}) for n in range(100)],
                                table=env.table)
        assert len(statements) == 1  # a batch is one statement, one round trip
    finally:
        engine.dispose()
    got = rows(env)
    assert [r["message_id"] for r in got] == [first, *many]
    assert got[0]["payload"] == {"via": "session"} and got[5]["headers"] == {"n": 4}
    assert note_count(env, notes) == 1


def test_sqlalchemy_async_session_and_connection(env: Env) -> None:
    async def main() -> list[str]:
        engine = create_async_engine(sqlalchemy_url(env))
        try:
            async with AsyncSession(engine) as session:
                one = await enqueue_async(session, exchange="", routing_key="q",
                                          payload=b"bytes", table=env.table)
                await session.commit()
            async with engine.begin() as connection:
                many = await enqueue_many_async(connection, [Event("", "q", {"n": 1}),
                                                             Event("", "q", {"n": 2})],
                                                table=env.table)
            async with engine.connect() as connection:
                await enqueue_async(connection, exchange="", routing_key="q", payload=0,
                                    table=env.table)
                await connection.rollback()
        finally:
            await engine.dispose()
        return [one, *many]

    ids = asyncio.run(main())
    got = rows(env)
    assert [r["message_id"] for r in got] == ids
    assert got[0]["payload_bytes"] == b"bytes"


def test_schema_sql_applies_through_sqlalchemy_as_an_alembic_migration_would(env: Env) -> None:
    table = f"alembic_{env.gid_prefix}"
    engine = sa.create_engine(sqlalchemy_url(env))
    try:
        with engine.begin() as connection:  # what op.execute(outbox_relay.schema_sql(...)) does
            connection.execute(sa.text(outbox_relay.schema_sql(table)))
            connection.execute(sa.text(outbox_relay.schema_sql(table)))  # idempotent
            enqueue(connection, exchange="", routing_key="q", payload=1, table=table)
            connection.execute(sa.text(outbox_relay.inbox_schema_sql(f"inbox_{env.gid_prefix}")))
        with engine.begin() as connection:
            assert connection.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar() == 1
            connection.execute(sa.text(f"DROP TABLE {table}, {table}_dead_letter, "
                                       f"inbox_{env.gid_prefix}, inbox_{env.gid_prefix}_keys"))
    finally:
        engine.dispose()


# -- Django -----------------------------------------------------------------------------------

DJANGO_RECIPE = '''
import json, sys
import django
from django.conf import settings

settings.configure(DATABASES={"default": json.loads(sys.argv[1])})
django.setup()

# --- the README's recipe ---
from django.db import connection, transaction
from outbox_relay import enqueue

def pay(order_id):
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO %s VALUES ('paid')" % sys.argv[3])
        enqueue(connection, exchange="orders", routing_key="order.paid",
                payload={"order_id": order_id}, ordering_key=f"order-{order_id}",
                table=sys.argv[2])
# ---

pay(1)
try:
    with transaction.atomic():
        pay(2)
        raise RuntimeError("rolled back")
except RuntimeError:
    pass
with transaction.atomic(), connection.cursor() as cursor:
    enqueue(cursor, exchange="orders", routing_key="order.paid", payload={"order_id": 3},
            table=sys.argv[2])
try:
    enqueue(connection, exchange="orders", routing_key="x", payload=0, table=sys.argv[2])
except Exception as exc:
    print(type(exc).__name__)
'''


def test_django_recipe_in_transaction_atomic(env: Env, notes: str) -> None:
    url = urlsplit(env.db_url)
    database = {"ENGINE": "django.db.backends.postgresql", "NAME": url.path.lstrip("/"),
                "USER": url.username, "PASSWORD": url.password or "", "HOST": url.hostname,
                "PORT": str(url.port)}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(DJANGO_RECIPE),
                           json.dumps(database), env.table, notes],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["NotInTransaction"]  # outside atomic(): refused
    assert [r["payload"]["order_id"] for r in rows(env)] == [1, 3]
    assert note_count(env, notes) == 1


# -- through the relay ------------------------------------------------------------------------


def test_the_relay_publishes_what_enqueue_wrote_and_dead_letters_what_it_refuses(
        env: Env) -> None:
    with psycopg.connect(env.db_url) as conn:
        keyed = enqueue(conn, exchange=env.exchange, routing_key="order.paid",
                        payload={"order_id": 7, "amount": 1.5}, ordering_key="order-7",
                        headers={"tenant": "acme", "ratio": 0.25}, table=env.table)
        raw = enqueue(conn, exchange=env.exchange, routing_key="blob", payload=b"\x01\x02",
                      content_type="application/x-blob", table=env.table)
        # The same values the API refuses, written with a plain INSERT: the relay dead-letters
        # them with the reason the API gave.
        reasons = {}
        for name, changes in {"long-key": {"routing_key": "r" * 256},
                              "big-header": {"headers": {"n": 2**70}}}.items():
            values = {"exchange": env.exchange, "routing_key": "ok", "payload": {"n": 1},
                      **changes}
            with pytest.raises(InvalidEvent) as caught:
                enqueue(conn, **values, table=env.table)
            reasons[name] = caught.value.reason
            conn.execute(sql.SQL("INSERT INTO {} (message_id, exchange, routing_key, payload, "
                                 "headers) VALUES (%s, %s, %s, '{{}}', %s)").format(
                Tables(env.table).outbox),
                (name, env.exchange, values["routing_key"],
                 psycopg.types.json.Jsonb(values.get("headers", {}))))
        conn.commit()
    relay = env.spawn("relay")
    try:
        wait_until(lambda: outbox_count(env) == 0, 30, "the relay to empty the outbox")
    finally:
        assert stop(relay) == 0, log_of(relay)
    with env.connect() as conn:
        dead = dict(conn.execute(sql.SQL("SELECT message_id, last_error FROM {}").format(
            Tables(env.table).dead_letter)).fetchall())
    assert dead == {"long-key": reasons["long-key"], "big-header": reasons["big-header"]}

    connection = pika.BlockingConnection(pika.URLParameters(env.amqp_url))
    try:
        channel = connection.channel()
        got = {}
        received: dict[str, InboxMessage] = {}
        for _ in range(2):
            method, properties, body = channel.basic_get(env.queue, auto_ack=True)
            assert method is not None
            got[properties.message_id] = (method.routing_key, properties, body)
            received[properties.message_id] = InboxMessage.from_pika(method, properties, body)
    finally:
        connection.close()
    routing_key, properties, body = got[keyed]
    assert routing_key == "order.paid" and json.loads(body) == {"order_id": 7, "amount": 1.5}
    assert properties.content_type == "application/json" and properties.delivery_mode == 2
    headers = dict(properties.headers)
    position = headers.pop(outbox_relay.POSITION_HEADER)
    assert isinstance(position, int) and position > 0
    assert headers == {"tenant": "acme", "ratio": pytest.approx(0.25),
                       outbox_relay.ORDERING_KEY_HEADER: "order-7"}
    # What the inbox's per-key check reads.
    assert (received[keyed].ordering_key, received[keyed].position) == ("order-7", position)
    assert (received[raw].ordering_key, received[raw].position) == (None, None)
    routing_key, properties, body = got[raw]
    assert (routing_key, body, properties.content_type) == ("blob", b"\x01\x02", "application/x-blob")
    assert properties.headers is None  # no ordering key: nothing added


class Status(enum.Enum):
    PAID = "paid"


@dataclasses.dataclass
class Customer:
    id: uuid.UUID
    since: date


def test_the_payloads_services_have_reach_the_consumer_as_plain_json(env: Env) -> None:
    """Decimal, datetime, date, UUID and Enum (and a dataclass through json_default) in a
    payload and its headers, a UUID as message id: stored by PostgreSQL, published by the
    relay, read by a consumer as the strings the docs say."""
    order = uuid.UUID("6f1c2a9e-2f4b-4c1e-9a57-0c8d7a3e5b21")
    paid_at = datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=timezone.utc)
    event: dict[str, Any] = dict(
        exchange=env.exchange, routing_key="order.paid", message_id=order,
        payload={"order_id": order, "amount": Decimal("19.90"), "paid_at": paid_at,
                 "due": date(2024, 6, 1), "status": Status.PAID,
                 "customer": Customer(uuid.UUID(int=7), date(2020, 1, 31))},
        headers={"tenant": uuid.UUID(int=1), "status": Status.PAID},
        json_default=dataclasses.asdict, table=env.table)
    with psycopg.connect(env.db_url) as conn:
        message_id = enqueue(conn, **event)
        conn.commit()
    assert message_id == str(order)
    recording = RecordingOutbox()  # what a service's unit test would have seen
    enqueue(recording, **event)
    recording.commit()
    recorded = recording.assert_enqueued()
    relay = env.spawn("relay")
    try:
        wait_until(lambda: outbox_count(env) == 0, 30, "the relay to empty the outbox")
    finally:
        assert stop(relay) == 0, log_of(relay)

    connection = pika.BlockingConnection(pika.URLParameters(env.amqp_url))
    try:
        method, properties, body = connection.channel().basic_get(env.queue, auto_ack=True)
    finally:
        connection.close()
    assert method is not None
    assert properties.message_id == "6f1c2a9e-2f4b-4c1e-9a57-0c8d7a3e5b21"
    assert json.loads(body) == {
        "order_id": "6f1c2a9e-2f4b-4c1e-9a57-0c8d7a3e5b21", "amount": "19.90",
        "paid_at": "2024-05-06T07:08:09.123456Z", "due": "2024-06-01", "status": "paid",
        "customer": {"id": "00000000-0000-0000-0000-000000000007", "since": "2020-01-31"}}
    assert properties.headers == {"tenant": "00000000-0000-0000-0000-000000000001",
                                  "status": "paid"}
    assert properties.content_type == "application/json"
    # The test double recorded the message as the relay sent it (the body's text aside:
    # PostgreSQL's jsonb writes its own).
    assert (recorded.message_id, recorded.exchange, recorded.routing_key) == (
        properties.message_id, env.exchange, method.routing_key)
    assert recorded.payload == json.loads(body) and json.loads(recorded.body) == json.loads(body)
    assert (recorded.content_type, recorded.headers) == (properties.content_type,
                                                         properties.headers)
