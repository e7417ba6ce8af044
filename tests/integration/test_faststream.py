"""The FastStream recipe of docs/python-api.md on real servers: the relay's events applied once
through the inbox by a FastStream subscriber (tests/integration/faststream_app.py), copies
included, and the ack only after the inbox's commit: a failed handler, a failing message and a
lost database connection leave nothing half applied and lose nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pika
import psycopg
import pytest
from faststream import TestApp
from psycopg import sql

from devenv.servers import free_port
from outbox_relay import Event, Inbox, InboxMessage, Outcome, enqueue_many
from tests.conftest import Env
from tests.integration.faststream_app import make_app
from tests.integration.test_pipeline import outbox_count, stop


@dataclass
class Consumer:
    env: Env
    inbox: Inbox
    effects: str
    queue: str
    dlq: str

    def app(self, handler: Callable[[psycopg.AsyncConnection[Any], InboxMessage], Awaitable[object]],
            outcomes: list[Outcome | None], *, database_url: str | None = None) -> Any:
        return make_app(database_url or self.env.db_url, self.env.amqp_url,
                        exchange=self.env.exchange,
                        queue=self.queue, binding="order.#", dead_letter_queue=self.dlq,
                        inbox=self.inbox, handler=handler, outcomes=outcomes)

    async def record(self, conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
        """The effect: one row per application of an event (no unique key: a second
        application would show as a second row)."""
        await conn.execute(sql.SQL("INSERT INTO {} (message_id, amount) VALUES (%s, %s)").format(
            sql.Identifier(self.effects)), (message.message_id, message.json()["amount"]))

    def applied(self) -> list[tuple[str, int]]:
        with self.env.connect() as conn:
            return [(m, a) for m, a in conn.execute(sql.SQL(
                "SELECT message_id, amount FROM {} ORDER BY message_id").format(
                    sql.Identifier(self.effects))).fetchall()]

    def counts(self) -> dict[str, int]:
        """Messages ready in the consumer's queue and its dead-letter queue (unacked ones are
        ready again once the app's channel is closed)."""
        connection = pika.BlockingConnection(pika.URLParameters(self.env.amqp_url))
        try:
            channel = connection.channel()
            return {name: channel.queue_declare(name, passive=True).method.message_count
                    for name in (self.queue, self.dlq)}
        finally:
            connection.close()

    def publish(self, bodies: dict[str, bytes]) -> None:
        """Publish as the relay would (persistent, message_id set), straight to the exchange."""
        connection = pika.BlockingConnection(pika.URLParameters(self.env.amqp_url))
        try:
            channel = connection.channel()
            channel.confirm_delivery()
            for message_id, body in bodies.items():
                channel.basic_publish(self.env.exchange, "order.paid", body, pika.BasicProperties(
                    message_id=message_id, delivery_mode=2, content_type="application/json"),
                    mandatory=True)
        finally:
            connection.close()


@pytest.fixture
def consumer(env: Env) -> Iterator[Consumer]:
    uid = env.gid_prefix
    c = Consumer(env, Inbox(f"inbox_{uid}", consumer="billing"), f"effects_{uid}",
                 f"billing.{uid}", f"billing.{uid}.dead")
    with env.connect() as conn:
        c.inbox.migrate(conn)
        conn.execute(sql.SQL("CREATE TABLE {} (message_id text NOT NULL, amount int NOT NULL)")
                     .format(sql.Identifier(c.effects)))
    connection, channel = env.amqp_channel()
    channel.queue_declare(c.dlq, durable=True)
    connection.close()
    yield c
    with env.connect() as conn:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}, {}, {}").format(
            sql.Identifier(c.effects), sql.Identifier(c.inbox.table),
            sql.Identifier(f"{c.inbox.table}_keys")))
    connection, channel = env.amqp_channel()
    channel.queue_delete(c.queue)
    channel.queue_delete(c.dlq)
    connection.close()


async def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def test_the_relays_events_and_their_copies_are_applied_once(consumer: Consumer) -> None:
    env = consumer.env
    events = [Event(exchange=env.exchange, routing_key="order.paid",
                    payload={"order": i, "amount": i}) for i in range(300)]
    with env.connect() as conn, conn.transaction():
        ids = enqueue_many(conn, events, table=env.table)
    expected = sorted((message_id, i) for i, message_id in enumerate(ids))
    outcomes: list[Outcome | None] = []

    async def run() -> None:
        async with TestApp(consumer.app(consumer.record, outcomes)):  # declares its queue
            relay = env.spawn("relay")
            await wait_for(lambda: len(outcomes) >= 300, 90, "the relay's 300 events")
            stop(relay)
            # Copies with the same message_id, as after a relay crash or a requeue.
            consumer.publish({message_id: b'{"order": %d, "amount": %d}' % (i, i)
                              for i, message_id in enumerate(ids[:30])})
            await wait_for(lambda: len(outcomes) >= 330, 30, "the 30 copies")

    asyncio.run(run())
    assert outbox_count(env) == 0
    assert consumer.applied() == expected
    assert outcomes.count(Outcome.APPLIED) == 300
    assert outcomes.count(Outcome.DUPLICATE) == 30
    assert len(outcomes) == 330
    assert consumer.counts() == {consumer.queue: 0, consumer.dlq: 0}  # all acked


def test_nothing_is_acked_before_the_inbox_commits(consumer: Consumer) -> None:
    """A handler that fails once (requeued, applied on redelivery), one that always fails
    (requeued once, then rejected to the dead-letter queue, never applied) and a database
    connection lost in the handler (requeued, the pool replaces the connection, applied)."""
    tries: dict[str, int] = {}

    async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
        tries[message.message_id] = tries.get(message.message_id, 0) + 1
        await consumer.record(conn, message)  # written, but rolled back unless committed
        if message.message_id == "flaky" and tries["flaky"] == 1:
            raise RuntimeError("a transient failure")
        if message.message_id == "poison":
            raise ValueError("never works")
        if message.message_id == "cut" and tries["cut"] == 1:
            await conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    outcomes: list[Outcome | None] = []
    bodies = {name: b'{"amount": %d}' % n
              for n, name in enumerate(("ok", "flaky", "poison", "cut"), start=1)}

    async def run() -> None:
        async with TestApp(consumer.app(handler, outcomes)):
            consumer.publish(bodies)
            await wait_for(lambda: len(outcomes) >= 7, 30, "4 messages, 3 of them twice")
            await asyncio.sleep(0.5)  # nothing else may arrive

    asyncio.run(run())
    assert consumer.applied() == [("cut", 4), ("flaky", 2), ("ok", 1)]
    assert tries == {"ok": 1, "flaky": 2, "poison": 2, "cut": 2}
    assert len(outcomes) == 7
    assert consumer.counts() == {consumer.queue: 0, consumer.dlq: 1}
    with consumer.env.connect() as conn:
        recorded = conn.execute(sql.SQL("SELECT message_id FROM {} ORDER BY 1").format(
            sql.Identifier(consumer.inbox.table))).fetchall()
    assert [r[0] for r in recorded] == ["cut", "flaky", "ok"]


def test_a_message_that_gets_no_database_connection_is_requeued(consumer: Consumer) -> None:
    """The pool cannot connect (nothing listens there): after the pool's timeout the recipe's
    `finally` requeues the message, so it comes again (held unacked instead, it would not until
    the channel closed); it is neither acked nor dead-lettered, and stays queued."""
    outcomes: list[Outcome | None] = []
    nowhere = f"postgresql://nobody@127.0.0.1:{free_port()}/none?connect_timeout=1"

    async def run() -> None:
        async with TestApp(consumer.app(consumer.record, outcomes, database_url=nowhere)):
            consumer.publish({"early": b'{"amount": 1}'})
            await wait_for(lambda: len(outcomes) >= 2, 40, "two pool timeouts: a redelivery")

    asyncio.run(run())
    assert outcomes[:2] == [None, None]
    assert consumer.counts() == {consumer.queue: 1, consumer.dlq: 0}
    assert consumer.applied() == []
