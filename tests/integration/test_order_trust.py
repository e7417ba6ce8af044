"""Order headers a consumer can trust, against real servers: the relay sets its connection's user
as every message's user_id (RabbitMQ refuses any other), and refuses to start with one RabbitMQ
does not take; the inbox's per-key check trusts the order headers only of messages a relay
published."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from typing import Any

import pika
import pika.exceptions
import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from devenv import checker
from devenv.servers import PostgresServer, RabbitServer
from outbox_relay import ORDERING_KEY_HEADER, POSITION_HEADER, Inbox, InboxMessage, Outcome
from outbox_relay.tables import Tables
from tests.conftest import Env, External, finish_env, make_env, server_url
from tests.integration.test_hostile_rows import dead_letters, insert
from tests.integration.test_pipeline import log_of, outbox_count, stop, wait_until
from tests.integration.test_roles import with_user


@pytest.fixture(scope="module")
def rabbit(rabbit_server: RabbitServer | External) -> Iterator[RabbitServer]:
    """A node whose users the test may manage."""
    if isinstance(rabbit_server, RabbitServer):
        yield rabbit_server
        return
    with RabbitServer() as own:
        yield own


@pytest.fixture
def uenv(pg_server: PostgresServer | External, rabbit: RabbitServer) -> Iterator[Env]:
    e = make_env(server_url(pg_server), rabbit.url, tag="u")
    yield e
    finish_env(e)


def produce(env: Env, count: int = 20, prefix: str = "ev") -> list[str]:
    with env.connect() as conn:
        return checker.insert_events(conn, env.table, count, exchange=env.exchange,
                                     routing_key=env.routing_key, prefix=prefix, keys=4)


def deliveries(env: Env) -> list[tuple[Any, Any, bytes]]:
    """(method, properties, body) of every message in the test's queue (taken off it)."""
    conn, channel = env.amqp_channel()
    try:
        found = []
        while True:
            method, properties, body = channel.basic_get(env.queue, auto_ack=True)
            if method is None:
                return found
            found.append((method, properties, body))
    finally:
        conn.close()


def received(env: Env) -> list[Any]:
    """The properties of every message in the test's queue (taken off it)."""
    return [properties for _method, properties, _body in deliveries(env)]


def test_every_message_carries_the_relays_user_as_user_id(env: Env) -> None:
    produced = produce(env)
    proc = env.spawn("relay", OUTBOX_BATCH_SIZE="5")
    wait_until(lambda: outbox_count(env) == 0, 60, "the outbox to empty")
    assert stop(proc) == 0, log_of(proc)

    # The test broker's URL names guest: the user RabbitMQ checked each user_id against.
    messages = received(env)
    assert sorted(p.message_id for p in messages) == sorted(produced)
    assert {p.user_id for p in messages} == {"guest"}


def test_an_explicit_user_id_that_is_the_connections_user(env: Env) -> None:
    produced = produce(env)
    proc = env.spawn("relay", OUTBOX_AMQP_USER_ID="guest")
    wait_until(lambda: outbox_count(env) == 0, 60, "the outbox to empty")
    assert stop(proc) == 0, log_of(proc)
    messages = received(env)
    assert sorted(p.message_id for p in messages) == sorted(produced)
    assert {p.user_id for p in messages} == {"guest"}


def test_a_user_id_rabbitmq_refuses_stops_the_relay_before_any_claim(env: Env) -> None:
    # Had it started, every batch would have failed on it (RabbitMQ closes the channel), and
    # its rows counted attempts until they were dead-lettered.
    produced = produce(env)
    proc = env.spawn("relay", OUTBOX_AMQP_USER_ID="not-the-relay")
    assert proc.wait(60) == 3, log_of(proc)
    errors = [line for line in log_of(proc).splitlines() if " ERROR " in line]
    assert len(errors) == 1, log_of(proc)
    assert "RabbitMQ refused user_id 'not-the-relay'" in errors[0]
    assert "set OUTBOX_AMQP_USER_ID" in errors[0]
    with env.connect() as conn:
        attempts = conn.execute(sql.SQL("SELECT count(*), max(attempts) FROM {}").format(
            Tables(env.table).outbox)).fetchone()
    assert attempts == (len(produced), 0)
    assert received(env) == []


# -- the attack of issue 32 end to end: a producer row and a broker user forge the headers --------


FORGED = {ORDERING_KEY_HEADER: "order-1", POSITION_HEADER: 2**63 - 1}


def publish_as_another_user(env: Env, rabbit: RabbitServer) -> None:
    """Another user of the vhost, who may write to the events' exchange, publishes a message
    with the order headers at the largest position; it cannot claim to be the relay."""
    user, password = f"{env.gid_prefix}-forger", secrets.token_hex(8)
    rabbit.ctl("add_user", user, password)
    try:
        rabbit.ctl("set_permissions", "-p", "/", user, "^$", f"^{re.escape(env.exchange)}$", "^$")
        conn = pika.BlockingConnection(pika.URLParameters(with_user(env.amqp_url, user, password)))
        try:
            channel = conn.channel()
            channel.confirm_delivery()
            channel.basic_publish(env.exchange, "forged", b"{}", pika.BasicProperties(
                message_id="forged-by-a-broker-user", delivery_mode=2, headers=FORGED))
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
                channel.basic_publish(env.exchange, "forged", b"{}", pika.BasicProperties(
                    message_id="posing-as-the-relay", delivery_mode=2, headers=FORGED,
                    user_id="guest"))
            assert refused.value.reply_code == 406
        finally:
            if conn.is_open:
                conn.close()
    finally:
        rabbit.ctl("delete_user", user)


def test_no_row_and_no_broker_user_can_make_the_inbox_skip_events(
        uenv: Env, rabbit: RabbitServer) -> None:
    env = uenv
    publish_as_another_user(env, rabbit)
    insert(env, "forged-by-a-row", headers=Jsonb(FORGED))  # a keyless row
    genuine = [insert(env, f"genuine-{n}", ordering_key="order-1") for n in range(5)]
    proc = env.spawn("relay")
    wait_until(lambda: outbox_count(env) == 0, 60, "the outbox to empty")
    assert stop(proc) == 0, log_of(proc)
    assert set(dead_letters(env)) == {"forged-by-a-row"}

    inbox = Inbox(f"inbox_{env.gid_prefix}", consumer="orders", check_order=True,
                  relay_users={"guest"})  # the relay's user (the test broker's URL names guest)
    applied: list[str] = []
    outcomes: dict[str, Outcome | None] = {}
    with psycopg.connect(env.db_url, autocommit=True) as db:
        inbox.migrate(db)
        try:
            conn, channel = env.amqp_channel()
            try:
                for method, properties, body in channel.consume(env.queue, inactivity_timeout=1):
                    if method is None:
                        break
                    outcomes[properties.message_id] = inbox.handle_pika(
                        db, channel, method, properties, body,
                        lambda _conn, m: applied.append(m.message_id))
            finally:
                conn.close()
        finally:
            db.execute(sql.SQL("DROP TABLE {}, {}").format(
                sql.Identifier(inbox.table), sql.Identifier(f"{inbox.table}_keys")))
    # Before: the forged message was trusted, and every genuine event came out STALE.
    assert outcomes == {"forged-by-a-broker-user": Outcome.APPLIED,
                        **dict.fromkeys(genuine, Outcome.APPLIED)}
    assert applied == ["forged-by-a-broker-user", *genuine]
    assert (inbox.untrusted_order, inbox.stale_skipped) == (1, 0)


def test_a_relays_message_read_back_is_trusted(uenv: Env) -> None:
    # The genuine path through the broker: user_id set by the relay, checked by RabbitMQ, read
    # by InboxMessage.from_pika, so an older event of the key is refused.
    env = uenv
    insert(env, "new", ordering_key="order-1")
    proc = env.spawn("relay")
    wait_until(lambda: outbox_count(env) == 0, 60, "the outbox to empty")
    assert stop(proc) == 0, log_of(proc)
    (delivered,) = [InboxMessage.from_pika(*m) for m in deliveries(env)]
    older = InboxMessage(message_id="old", body=b"{}", user_id="guest", headers={
        ORDERING_KEY_HEADER: "order-1", POSITION_HEADER: delivered.position - 1})  # type: ignore[operator]
    inbox = Inbox(f"inbox_{env.gid_prefix}", consumer="orders", check_order=True,
                  relay_users={"guest"})
    with psycopg.connect(env.db_url, autocommit=True) as db:
        inbox.migrate(db)
        try:
            outcomes = [inbox.process(db, m, lambda _c, _m: None) for m in (delivered, older)]
        finally:
            db.execute(sql.SQL("DROP TABLE {}, {}").format(
                sql.Identifier(inbox.table), sql.Identifier(f"{inbox.table}_keys")))
    assert delivered.user_id == "guest" and delivered.ordering_key == "order-1"
    assert outcomes == [Outcome.APPLIED, Outcome.STALE]
    assert (inbox.untrusted_order, inbox.stale_skipped) == (0, 1)

