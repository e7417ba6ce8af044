"""Order headers a consumer can trust, against real servers: the relay sets its connection's user
as every message's user_id (RabbitMQ refuses any other), and refuses to start with one RabbitMQ
does not take; the inbox's per-key check trusts the order headers only of messages a relay
published."""

from __future__ import annotations

from typing import Any

from psycopg import sql

from devenv import checker
from outbox_relay.tables import Tables
from tests.conftest import Env
from tests.integration.test_pipeline import log_of, outbox_count, stop, wait_until


def produce(env: Env, count: int = 20, prefix: str = "ev") -> list[str]:
    with env.connect() as conn:
        return checker.insert_events(conn, env.table, count, exchange=env.exchange,
                                     routing_key=env.routing_key, prefix=prefix, keys=4)


def received(env: Env) -> list[Any]:
    """The properties of every message in the test's queue (taken off it)."""
    conn, channel = env.amqp_channel()
    try:
        found = []
        while True:
            method, properties, _body = channel.basic_get(env.queue, auto_ack=True)
            if method is None:
                return found
            found.append(properties)
    finally:
        conn.close()


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
