"""The consumer's inbox against the real PostgreSQL and RabbitMQ: a duplicate is acked without
running the handler, a crash before the commit means one effect after the redelivery, a crash
after the commit means a duplicate, a handler's exception follows the documented policy
(OnError), a lost database connection requeues, the per-key check, retention, the CLI."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aio_pika
import pika
import psycopg
import psycopg.errors
import pytest
import sqlalchemy as sa
from psycopg import sql
from sqlalchemy.orm import Session

from outbox_relay import (
    ORDERING_KEY_HEADER,
    POSITION_HEADER,
    ConfigError,
    Inbox,
    InboxError,
    InboxMessage,
    NotInTransaction,
    OnError,
    Outcome,
)
from tests.conftest import ROOT, Env
from tests.fix_proxy import ProxyFactory


@dataclass
class Consumer:
    """One test's inbox table, effects table (one row per handler run that committed) and
    queue with a dead-letter queue."""

    env: Env
    inbox: Inbox
    effects: str
    queue: str
    dlq: str

    def effect_counts(self) -> dict[str, int]:
        with self.env.connect() as conn:
            return dict(conn.execute(sql.SQL(
                "SELECT message_id, count(*) FROM {} GROUP BY message_id").format(
                sql.Identifier(self.effects))).fetchall())

    def inbox_ids(self) -> set[str]:
        with self.env.connect() as conn:
            return {r[0] for r in conn.execute(sql.SQL("SELECT message_id FROM {}").format(
                sql.Identifier(self.inbox.table))).fetchall()}

    def handler(self, calls: list[str] | None = None, *, fail: int = 0) -> Any:
        """A handler writing its effect; the first ``fail`` runs raise after writing it."""
        insert = sql.SQL("INSERT INTO {} (message_id) VALUES (%s)").format(
            sql.Identifier(self.effects))
        runs = calls if calls is not None else []

        def handle(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
            conn.execute(insert, (message.message_id,))
            runs.append(message.message_id)
            if len(runs) <= fail:
                raise RuntimeError("handler failed")

        return handle

    def publish(self, *ids: str | None, headers: dict[str, Any] | None = None,
                user_id: str | None = None) -> None:
        connection = pika.BlockingConnection(pika.URLParameters(self.env.amqp_url))
        try:
            channel = connection.channel()
            channel.confirm_delivery()
            for message_id in ids:
                channel.basic_publish("", self.queue, b'{"n": 1}', pika.BasicProperties(
                    message_id=message_id, delivery_mode=2, headers=headers, user_id=user_id))
        finally:
            connection.close()

    def consume(self, conn: psycopg.Connection[Any], handler: Any, *,
                on_error: OnError = OnError.REQUEUE_ONCE, inbox: Inbox | None = None
                ) -> list[Outcome | None]:
        """handle_pika on every delivery until the queue is idle for half a second."""
        outcomes: list[Outcome | None] = []
        connection = pika.BlockingConnection(pika.URLParameters(self.env.amqp_url))
        try:
            channel = connection.channel()
            for method, properties, body in channel.consume(self.queue, inactivity_timeout=0.5):
                if method is None:
                    break
                outcomes.append((inbox or self.inbox).handle_pika(
                    conn, channel, method, properties, body, handler, on_error=on_error))
        finally:
            connection.close()
        return outcomes

    def dead_lettered(self) -> list[str | None]:
        connection = pika.BlockingConnection(pika.URLParameters(self.env.amqp_url))
        try:
            channel = connection.channel()
            ids = []
            while True:
                method, properties, _ = channel.basic_get(self.dlq, auto_ack=True)
                if method is None:
                    return ids
                ids.append(properties.message_id)
        finally:
            connection.close()

    def run_process(self, *mode: str) -> tuple[int, list[str]]:
        done = subprocess.run(
            [sys.executable, "-m", "tests.integration.inbox_consumer", self.env.db_url,
             self.env.amqp_url, self.queue, self.inbox.table, self.effects, *mode],
            cwd=ROOT, capture_output=True, text=True, timeout=60)
        return done.returncode, done.stdout.split("\n")[:-1]


@pytest.fixture
def consumer(env: Env) -> Iterator[Consumer]:
    uid = env.gid_prefix
    c = Consumer(env, Inbox(f"inbox_{uid}", consumer="test"), f"effects_{uid}",
                 f"inbox.{uid}", f"inbox.{uid}.dead")
    with env.connect() as conn:
        c.inbox.migrate(conn)
        conn.execute(sql.SQL("CREATE TABLE {} (message_id text NOT NULL)").format(
            sql.Identifier(c.effects)))
    connection, channel = env.amqp_channel()
    channel.queue_declare(c.dlq, durable=True)
    channel.queue_declare(c.queue, durable=True, arguments={
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": c.dlq})
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


# The user the relays publish as (their messages' user_id, which RabbitMQ checks).
RELAY_USER = "relay"


def message(message_id: str, key: str | None = None, position: int | None = None, *,
            user_id: str | None = RELAY_USER) -> InboxMessage:
    headers: dict[str, Any] = {}
    if key is not None:
        headers[ORDERING_KEY_HEADER] = key
    if position is not None:
        headers[POSITION_HEADER] = position
    return InboxMessage(message_id=message_id, body=b"{}", headers=headers, user_id=user_id)


def ordered_inbox(consumer: Consumer, name: str = "ordered") -> Inbox:
    return Inbox(consumer.inbox.table, consumer=name, check_order=True, relay_users={RELAY_USER})


# -- process: one transaction ----------------------------------------------------------------


def test_a_duplicate_is_recorded_once_and_its_handler_runs_once(consumer: Consumer) -> None:
    calls: list[str] = []
    with consumer.env.connect() as conn:
        first = consumer.inbox.process(conn, message("m-1"), consumer.handler(calls))
        again = consumer.inbox.process(conn, message("m-1"), consumer.handler(calls))
    assert (first, again) == (Outcome.APPLIED, Outcome.DUPLICATE)
    assert calls == ["m-1"] and consumer.effect_counts() == {"m-1": 1}


def test_a_non_autocommit_connection_commits_too(consumer: Consumer) -> None:
    with psycopg.connect(consumer.env.db_url) as conn:
        assert consumer.inbox.process(conn, message("m-1"), consumer.handler()) is Outcome.APPLIED
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert consumer.effect_counts() == {"m-1": 1}


def test_a_connection_with_a_dict_row_factory_works_too(consumer: Consumer) -> None:
    with psycopg.connect(consumer.env.db_url, autocommit=True,
                         row_factory=psycopg.rows.dict_row) as conn:
        outcomes = [consumer.inbox.process(conn, message("m-1"), consumer.handler())
                    for _ in range(2)]
    assert outcomes == [Outcome.APPLIED, Outcome.DUPLICATE]


def test_another_consumer_of_the_same_table_applies_the_message_too(consumer: Consumer) -> None:
    other = Inbox(consumer.inbox.table, consumer="search-index")
    with consumer.env.connect() as conn:
        assert consumer.inbox.process(conn, message("m-1"), consumer.handler()) is Outcome.APPLIED
        assert other.process(conn, message("m-1"), consumer.handler()) is Outcome.APPLIED
        assert other.process(conn, message("m-1"), consumer.handler()) is Outcome.DUPLICATE
    assert consumer.effect_counts() == {"m-1": 2}


def test_a_handler_exception_rolls_back_its_effect_and_the_record(consumer: Consumer) -> None:
    with consumer.env.connect() as conn:
        with pytest.raises(RuntimeError):
            consumer.inbox.process(conn, message("m-1"), consumer.handler(fail=1))
        assert consumer.effect_counts() == {} and consumer.inbox_ids() == set()
        assert consumer.inbox.process(conn, message("m-1"), consumer.handler()) is Outcome.APPLIED
    assert consumer.effect_counts() == {"m-1": 1}


def test_a_serialization_failure_runs_the_transaction_again(consumer: Consumer) -> None:
    calls: list[str] = []
    handle = consumer.handler(calls)

    def flaky(conn: psycopg.Connection[Any], msg: InboxMessage) -> None:
        handle(conn, msg)
        if len(calls) == 1:
            raise psycopg.errors.SerializationFailure("could not serialize access")

    with consumer.env.connect() as conn:
        assert consumer.inbox.process(conn, message("m-1"), flaky) is Outcome.APPLIED
    assert calls == ["m-1", "m-1"] and consumer.effect_counts() == {"m-1": 1}


def test_process_refuses_a_connection_inside_a_transaction(consumer: Consumer) -> None:
    with psycopg.connect(consumer.env.db_url) as conn:
        conn.execute("SELECT 1")
        with pytest.raises(InboxError, match="no transaction open"):
            consumer.inbox.process(conn, message("m-1"), consumer.handler())


def test_two_copies_processed_at_once_apply_once(consumer: Consumer) -> None:
    """The second copy waits for the first one's transaction, then finds it recorded."""
    started = threading.Event()
    release = threading.Event()
    calls: list[str] = []
    handle = consumer.handler(calls)

    def slow(conn: psycopg.Connection[Any], msg: InboxMessage) -> None:
        handle(conn, msg)
        started.set()
        assert release.wait(10)

    outcomes: list[Outcome] = []

    def first() -> None:
        with consumer.env.connect() as conn:
            outcomes.append(consumer.inbox.process(conn, message("m-1"), slow))

    thread = threading.Thread(target=first)
    thread.start()
    assert started.wait(10)
    with consumer.env.connect() as conn:
        timer = threading.Timer(0.5, release.set)
        timer.start()
        second = consumer.inbox.process(conn, message("m-1"), handle)
    thread.join(10)
    assert (outcomes, second) == ([Outcome.APPLIED], Outcome.DUPLICATE)
    assert calls == ["m-1"] and consumer.effect_counts() == {"m-1": 1}


# -- the per-key check (opt-in) ----------------------------------------------------------------


def test_check_order_skips_an_event_older_than_the_last_applied_for_its_key(
        consumer: Consumer) -> None:
    ordered = ordered_inbox(consumer)
    handle = consumer.handler()
    with consumer.env.connect() as conn:
        outcomes = [ordered.process(conn, m, handle) for m in (
            message("a5", "k", 5), message("a3", "k", 3), message("b1", "other", 1),
            message("a7", "k", 7), message("a7", "k", 7), message("a6", "k", 6),
            message("no-key"), message("key-without-position", "k"))]
        unordered = consumer.inbox.process(conn, message("a3", "k", 3), handle)
    assert outcomes == [Outcome.APPLIED, Outcome.STALE, Outcome.APPLIED, Outcome.APPLIED,
                        Outcome.DUPLICATE, Outcome.STALE, Outcome.APPLIED, Outcome.APPLIED]
    assert unordered is Outcome.APPLIED  # check_order off: another consumer, no check
    assert consumer.effect_counts() == {"a5": 1, "b1": 1, "a7": 1, "no-key": 1,
                                        "key-without-position": 1, "a3": 1}
    with consumer.env.connect() as conn:
        # A stale event is recorded (a copy of it later is a plain duplicate).
        assert ordered.process(conn, message("a3", "k", 3), handle) is Outcome.DUPLICATE
    assert (ordered.stale_skipped, ordered.untrusted_order) == (2, 0)


def test_check_order_counts_and_logs_every_event_it_skips(
        consumer: Consumer, caplog: pytest.LogCaptureFixture) -> None:
    ordered = ordered_inbox(consumer)
    with consumer.env.connect() as conn, caplog.at_level(logging.WARNING, "outbox_relay.inbox"):
        key = "k\x1b[2J"  # a producer's key, with a terminal escape in it
        for m in (message("a5", key, 5), message("a4\nforged line", key, 4),
                  message("a5", key, 5)):
            ordered.process(conn, m, consumer.handler())
    (line,) = [r for r in caplog.records if getattr(r, "action", None) == "inbox_event_stale"]
    assert (line.consumer, line.message_id, line.ordering_key, line.position) == (  # type: ignore[attr-defined]
        "ordered", "a4\nforged line", "k\x1b[2J", 4)
    # The producer's text is escaped in the message: one line, no terminal escape.
    assert line.getMessage() == ("inbox ordered: event 'a4\\nforged line' skipped, handler not "
                                 "run: position 4 of key 'k\\x1b[2J' is not past the last one "
                                 "applied")
    assert ordered.stale_skipped == 1


def test_check_order_trusts_the_order_headers_of_a_relays_message_only(
        consumer: Consumer, caplog: pytest.LogCaptureFixture) -> None:
    # Another user of the vhost published a message with the order headers, at the largest
    # position: trusted, it would make every later event of the key STALE (issue 32).
    ordered = ordered_inbox(consumer)
    handle = consumer.handler()
    with consumer.env.connect() as conn, caplog.at_level(logging.WARNING, "outbox_relay.inbox"):
        outcomes = [ordered.process(conn, m, handle) for m in (
            message("forged", "k", 2**63 - 1, user_id="intruder"),
            message("unsigned", "k", 2**63 - 1, user_id=None),
            message("a1", "k", 1), message("a2", "k", 2),
            message("forged-old", "k", 1, user_id="intruder"),  # older: applied all the same
            message("a0", "k", 0))]
    assert outcomes == [Outcome.APPLIED] * 5 + [Outcome.STALE]
    assert consumer.effect_counts() == {"forged": 1, "unsigned": 1, "a1": 1, "a2": 1,
                                        "forged-old": 1}
    assert (ordered.untrusted_order, ordered.stale_skipped) == (3, 1)
    untrusted = [r for r in caplog.records if getattr(r, "action", None) == "inbox_order_untrusted"]
    assert [(r.message_id, r.user_id) for r in untrusted] == [  # type: ignore[attr-defined]
        ("forged", "intruder"), ("unsigned", None), ("forged-old", "intruder")]
    with consumer.env.connect() as conn:
        # Nothing of the untrusted ones was kept as the key's position.
        assert conn.execute(sql.SQL("SELECT position, message_id FROM {} WHERE consumer = %s")
                            .format(sql.Identifier(f"{consumer.inbox.table}_keys")),
                            ("ordered",)).fetchall() == [(2, "a2")]


def test_messages_without_order_headers_are_neither_checked_nor_counted(
        consumer: Consumer) -> None:
    ordered = ordered_inbox(consumer)
    with consumer.env.connect() as conn:
        for m in (message("plain", user_id=None), message("key-only", "k", user_id="x")):
            assert ordered.process(conn, m, consumer.handler()) is Outcome.APPLIED
    assert (ordered.untrusted_order, ordered.stale_skipped) == (0, 0)


@pytest.mark.parametrize(("users", "error"), [
    (None, "check_order needs relay_users"),
    ("relay", "not one str"),
    ([], "relay_users is empty"),
    (["relay", ""], "non-empty str"),
])
def test_check_order_needs_the_relays_users(users: Any, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        Inbox("inbox", check_order=True, relay_users=users)


def test_from_pika_and_aio_pika_carry_the_user_id(consumer: Consumer) -> None:
    consumer.publish("m-1", user_id="guest")  # the test broker's user: RabbitMQ takes it
    connection = pika.BlockingConnection(pika.URLParameters(consumer.env.amqp_url))
    try:
        method, properties, body = connection.channel().basic_get(consumer.queue, auto_ack=True)
    finally:
        connection.close()
    assert InboxMessage.from_pika(method, properties, body).user_id == "guest"

    async def main() -> str | None:
        consumer.publish("m-2", user_id="guest")
        connection = await aio_pika.connect(consumer.env.amqp_url)
        async with connection:
            queue = await (await connection.channel()).get_queue(consumer.queue)
            incoming = await queue.get(timeout=10)
            await incoming.ack()
            return InboxMessage.from_aio_pika(incoming).user_id

    assert asyncio.run(main()) == "guest"


# -- record: the step for a transaction of the caller's own ------------------------------------


def test_record_in_a_sqlalchemy_session(consumer: Consumer) -> None:
    engine = sa.create_engine(consumer.env.db_url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        for _ in range(2):
            with Session(engine) as session, session.begin():
                if consumer.inbox.record(session, message("m-1")) is Outcome.APPLIED:
                    session.execute(sa.text(f"INSERT INTO {consumer.effects} VALUES ('m-1')"))
    finally:
        engine.dispose()
    assert consumer.effect_counts() == {"m-1": 1}


def test_record_needs_an_open_transaction(consumer: Consumer) -> None:
    with consumer.env.connect() as conn, pytest.raises(NotInTransaction):
        consumer.inbox.record(conn, message("m-1"))


# -- pika: ack after commit, the error policy ---------------------------------------------------


def test_pika_duplicates_are_acked_without_running_the_handler(consumer: Consumer) -> None:
    consumer.publish("m-1", "m-2", "m-1", "m-1")
    calls: list[str] = []
    with consumer.env.connect() as conn:
        outcomes = consumer.consume(conn, consumer.handler(calls))
    assert outcomes == [Outcome.APPLIED, Outcome.APPLIED, Outcome.DUPLICATE, Outcome.DUPLICATE]
    assert calls == ["m-1", "m-2"] and consumer.effect_counts() == {"m-1": 1, "m-2": 1}
    assert consumer.dead_lettered() == []  # all acked: nothing requeued or rejected


@pytest.mark.parametrize(("policy", "fail", "runs", "applied", "dead"), [
    (OnError.REQUEUE_ONCE, 99, 2, {}, ["m-1"]),  # requeued once, then rejected to the DLX
    (OnError.REQUEUE_ONCE, 1, 2, {"m-1": 1}, []),  # the redelivery succeeds
    (OnError.REJECT, 99, 1, {}, ["m-1"]),
    (OnError.REQUEUE, 3, 4, {"m-1": 1}, []),  # redelivered until the handler succeeds
])
def test_pika_a_handler_exception_follows_the_policy(
        consumer: Consumer, policy: OnError, fail: int, runs: int, applied: dict[str, int],
        dead: list[str]) -> None:
    consumer.publish("m-1")
    calls: list[str] = []
    with consumer.env.connect() as conn:
        outcomes = consumer.consume(conn, consumer.handler(calls, fail=fail), on_error=policy)
    assert len(calls) == runs and outcomes[-1] == (Outcome.APPLIED if applied else None)
    assert consumer.effect_counts() == applied  # a failed run stored nothing
    assert consumer.dead_lettered() == dead


def test_pika_a_message_without_message_id_is_rejected_unhandled(consumer: Consumer) -> None:
    consumer.publish(None)
    calls: list[str] = []
    with consumer.env.connect() as conn:
        assert consumer.consume(conn, consumer.handler(calls), on_error=OnError.REQUEUE) == [None]
    assert calls == [] and consumer.dead_lettered() == [None]


def test_pika_a_lost_database_connection_requeues_and_raises(
        consumer: Consumer, proxies: ProxyFactory) -> None:
    consumer.publish("m-1")
    proxy = proxies(consumer.env.db_url)
    insert = sql.SQL("INSERT INTO {} (message_id) VALUES (%s)").format(
        sql.Identifier(consumer.effects))

    def cut_midway(conn: psycopg.Connection[Any], msg: InboxMessage) -> None:
        conn.execute(insert, (msg.message_id,))
        proxy.cut()
        conn.execute("SELECT 1")  # the session is gone: this fails

    with psycopg.connect(proxy.url(consumer.env.db_url), autocommit=True) as conn, \
            pytest.raises(psycopg.OperationalError):
        consumer.consume(conn, cut_midway, on_error=OnError.REJECT)
    assert consumer.effect_counts() == {}  # rolled back with the session
    with consumer.env.connect() as conn:
        assert consumer.consume(conn, consumer.handler()) == [Outcome.APPLIED]
    assert consumer.effect_counts() == {"m-1": 1} and consumer.dead_lettered() == []


def test_pika_a_crash_before_the_commit_applies_once_after_redelivery(consumer: Consumer) -> None:
    consumer.publish("m-1", "m-2", "m-3")
    code, lines = consumer.run_process("in_handler", "m-2")
    assert code == -9 and lines == ["applied m-1"]
    assert consumer.effect_counts() == {"m-1": 1}  # m-2's effect died with its transaction
    code, lines = consumer.run_process()
    assert code == 0 and lines == ["applied m-2", "applied m-3"]
    assert consumer.effect_counts() == {"m-1": 1, "m-2": 1, "m-3": 1}


def test_pika_a_crash_after_the_commit_makes_a_duplicate(consumer: Consumer) -> None:
    consumer.publish("m-1", "m-2")
    code, lines = consumer.run_process("after_commit", "m-1")
    assert code == -9 and lines == []
    assert consumer.effect_counts() == {"m-1": 1}  # committed, but never acked
    code, lines = consumer.run_process()
    assert code == 0 and lines == ["duplicate m-1", "applied m-2"]
    assert consumer.effect_counts() == {"m-1": 1, "m-2": 1}


# -- aio-pika ---------------------------------------------------------------------------------


def test_aio_pika_duplicates_and_the_error_policy(consumer: Consumer) -> None:
    consumer.publish("m-1", "m-1", "bad", "m-2")
    insert = sql.SQL("INSERT INTO {} (message_id) VALUES (%s)").format(
        sql.Identifier(consumer.effects))
    calls: list[str] = []

    async def handler(conn: psycopg.AsyncConnection[Any], msg: InboxMessage) -> None:
        await conn.execute(insert, (msg.message_id,))
        calls.append(msg.message_id)
        if msg.message_id == "bad":
            raise RuntimeError("handler failed")

    async def main() -> list[Outcome | None]:
        outcomes: list[Outcome | None] = []
        async with await psycopg.AsyncConnection.connect(consumer.env.db_url,
                                                         autocommit=True) as db:
            connection = await aio_pika.connect(consumer.env.amqp_url)
            async with connection:
                channel = await connection.channel()
                queue = await channel.get_queue(consumer.queue)
                while True:
                    incoming = await queue.get(no_ack=False, fail=False, timeout=5)
                    if incoming is None:
                        break
                    outcomes.append(await consumer.inbox.handle_aio_pika(db, incoming, handler))
        return outcomes

    outcomes = asyncio.run(main())
    # "bad" fails, is requeued once (to its place in the queue), fails again and is rejected
    # to the DLX.
    assert outcomes == [Outcome.APPLIED, Outcome.DUPLICATE, None, None, Outcome.APPLIED]
    assert calls == ["m-1", "bad", "bad", "m-2"]
    assert consumer.effect_counts() == {"m-1": 1, "m-2": 1}
    assert consumer.dead_lettered() == ["bad"]


def test_aio_pika_callback_consumes_through_the_inbox(consumer: Consumer) -> None:
    consumer.publish("m-1", "m-2", "m-1")
    insert = sql.SQL("INSERT INTO {} (message_id) VALUES (%s)").format(
        sql.Identifier(consumer.effects))

    async def handler(conn: psycopg.AsyncConnection[Any], msg: InboxMessage) -> None:
        await conn.execute(insert, (msg.message_id,))

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(consumer.env.db_url,
                                                         autocommit=True) as db:
            connection = await aio_pika.connect(consumer.env.amqp_url)
            async with connection:
                channel = await connection.channel()
                await channel.set_qos(prefetch_count=1)
                queue = await channel.get_queue(consumer.queue)
                await queue.consume(consumer.inbox.aio_pika_callback(db, handler))
                for _ in range(100):
                    declared = await channel.declare_queue(consumer.queue, passive=True)
                    if declared.declaration_result.message_count == 0 and \
                            sum(consumer.effect_counts().values()) == 2:
                        break
                    await asyncio.sleep(0.1)

    asyncio.run(main())
    assert consumer.effect_counts() == {"m-1": 1, "m-2": 1}
    assert consumer.dead_lettered() == []


# -- retention and the CLI ---------------------------------------------------------------------


def test_prune_deletes_entries_older_than_the_window(consumer: Consumer) -> None:
    ordered = ordered_inbox(consumer)
    with consumer.env.connect() as conn:
        for n in range(5):
            ordered.process(conn, message(f"old-{n}", f"k{n}", 1), consumer.handler())
        conn.execute(sql.SQL("UPDATE {} SET processed_at = now() - interval '8 days'").format(
            sql.Identifier(consumer.inbox.table)))
        conn.execute(sql.SQL("UPDATE {} SET applied_at = now() - interval '8 days'").format(
            sql.Identifier(f"{consumer.inbox.table}_keys")))
        ordered.process(conn, message("new", "k0", 2), consumer.handler())
        assert ordered.prune(conn, older_than=7 * 86400) == 5
        assert consumer.inbox_ids() == {"new"}
        keys = conn.execute(sql.SQL("SELECT ordering_key FROM {}").format(
            sql.Identifier(f"{consumer.inbox.table}_keys"))).fetchall()
        assert keys == [("k0",)]
        assert ordered.prune(conn) == 0


def test_outbox_inbox_cli_migrates_prunes_and_prints(consumer: Consumer) -> None:
    table = f"cli_{consumer.inbox.table}"
    env = consumer.env.cli_env(OUTBOX_INBOX_DATABASE_URL=consumer.env.db_url,
                               OUTBOX_INBOX_TABLE=table)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "outbox_relay.inbox_cli", *args], env=env,
                              cwd=ROOT, capture_output=True, text=True, timeout=60)

    try:
        printed = run("migrate", "--print")
        assert printed.returncode == 0 and f'CREATE TABLE IF NOT EXISTS "{table}"' in printed.stdout
        for _ in range(2):  # idempotent
            assert run("migrate").returncode == 0
        cli_inbox = Inbox(table)
        with consumer.env.connect() as conn:
            cli_inbox.process(conn, message("m-1"), lambda conn, msg: None)
            conn.execute(sql.SQL("UPDATE {} SET processed_at = now() - interval '2 hours'").format(
                sql.Identifier(table)))
        kept = run("prune", "--older-than", "3h")
        assert kept.returncode == 0 and "pruned 0 inbox entries" in kept.stdout
        pruned = run("prune", "--older-than", "90m")
        assert pruned.returncode == 0 and "pruned 1 inbox entry" in pruned.stdout, pruned
        bad = run("prune", "--older-than", "soon")
        assert bad.returncode == 2 and "OUTBOX_INBOX_RETENTION" not in bad.stderr
        assert "--older-than must be a positive age" in bad.stderr
    finally:
        with consumer.env.connect() as conn:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}, {}").format(
                sql.Identifier(table), sql.Identifier(f"{table}_keys")))
