"""A full queue pushes back on the rows routed to it, never on the rest (issue 32).

RabbitMQ nacks a message that a queue with ``x-overflow: reject-publish`` refuses because it
is full: a queue its consumer owns, bound to the relay's exchange. The rows routed there back
off, count attempts and are dead-lettered after OUTBOX_MAX_ATTEMPTS; every other row flows.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from psycopg import sql

from devenv import checker
from outbox_relay.tables import Tables
from tests.conftest import Env
from tests.integration.test_pipeline import log_of, stop


@pytest.fixture
def full_queue(env: Env) -> Iterator[str]:
    """A queue of one message at most, full, that refuses what comes (reject-publish), bound to
    the test's exchange for ``full.#``; the test's sink queue gets ``event.#`` only."""
    name = f"{env.queue}.full"
    conn, channel = env.amqp_channel()
    channel.queue_declare(name, durable=True, arguments={
        "x-max-length": 1, "x-overflow": "reject-publish"})
    channel.queue_bind(name, env.exchange, routing_key="full.#")
    channel.queue_unbind(env.queue, env.exchange, routing_key="#")
    channel.queue_bind(env.queue, env.exchange, routing_key="event.#")
    channel.confirm_delivery()
    channel.basic_publish("", name, b"filler", pika.BasicProperties(delivery_mode=2))
    conn.close()
    yield name
    conn, channel = env.amqp_channel()
    channel.queue_delete(name)
    conn.close()


def insert(env: Env, rows: list[dict[str, Any]]) -> list[str]:
    with env.connect() as conn:
        for row in rows:
            conn.execute(sql.SQL(
                "INSERT INTO {} (message_id, exchange, routing_key, ordering_key, payload) "
                "VALUES (%(message_id)s, %(exchange)s, %(routing_key)s, %(ordering_key)s, "
                "'{{}}')").format(Tables(env.table).outbox), row)
    return [row["message_id"] for row in rows]


def dead_letters(env: Env) -> dict[str, tuple[int, str]]:
    with env.connect() as conn:
        rows = conn.execute(sql.SQL("SELECT message_id, attempts, last_error FROM {}").format(
            Tables(env.table).dead_letter)).fetchall()
    return {r[0]: (r[1], r[2]) for r in rows}


def outbox_ids(env: Env) -> set[str]:
    with env.connect() as conn:
        rows = conn.execute(sql.SQL("SELECT message_id FROM {}").format(
            Tables(env.table).outbox)).fetchall()
    return {r[0] for r in rows}


def queue_depth(env: Env, queue: str) -> int:
    conn, channel = env.amqp_channel()
    try:
        return int(channel.queue_declare(queue, passive=True).method.message_count)
    finally:
        conn.close()


def test_a_full_queue_holds_back_only_the_rows_routed_to_it(env: Env, full_queue: str) -> None:
    # The refused rows come first: before the fix, every batch claimed them again.
    refused = insert(env, [
        {"message_id": f"full-{n}", "exchange": env.exchange, "routing_key": "full.x",
         "ordering_key": None} for n in range(10)])
    refused += insert(env, [
        {"message_id": f"full-fk-{n}", "exchange": env.exchange, "routing_key": "full.x",
         "ordering_key": "fk"} for n in range(3)])
    # Later rows of the same key, routed to the healthy queue: they wait behind the refused
    # rows of their key (per-key order), then behind the first one's dead letter.
    behind = insert(env, [
        {"message_id": f"behind-fk-{n}", "exchange": env.exchange,
         "routing_key": "event.created", "ordering_key": "fk"} for n in range(2)])
    with env.connect() as conn:
        healthy = checker.insert_events(conn, env.table, 3000, exchange=env.exchange,
                                        routing_key=env.routing_key)
    started = time.monotonic()
    relay = env.spawn("relay", OUTBOX_BATCH_SIZE="100", OUTBOX_MAX_ATTEMPTS="3")

    deliveries = checker.drain(env.amqp_url, env.queue, expected=set(healthy),
                               total_timeout=60)
    took = time.monotonic() - started
    delivered = {d.message_id for d in deliveries}
    assert set(healthy) <= delivered, (
        f"{len(set(healthy) - delivered)} of 3000 healthy rows not delivered in {took:.0f} s:"
        f"\n{log_of(relay)[-3000:]}")
    # Before, the refused rows came back in every batch and the relay held its connection off
    # after each nack (0.5 s, doubling to 30 s): 128 of the 3,000 arrived in 60 s. Now it
    # never lets go of the broker for them.
    log = log_of(relay)
    assert "action=disconnected" not in log and "action=connect_failed" not in log, log[-3000:]
    print(f"3000 healthy rows delivered in {took:.1f} s")

    # The keyless refused rows and the key's first one run out of attempts; the key's later
    # rows wait behind that dead letter (OutboxKeysBlocked), published never.
    expected_dead = set(refused) - {"full-fk-1", "full-fk-2"}
    deadline = time.monotonic() + 60
    while set(dead_letters(env)) != expected_dead and time.monotonic() < deadline:
        time.sleep(0.2)
    dead = dead_letters(env)
    assert set(dead) == expected_dead, (sorted(dead), log_of(relay)[-3000:])
    for message_id, (attempts, error) in dead.items():
        assert attempts == 3, (message_id, attempts, error)
        assert error == "nacked by the broker", (message_id, error)
    assert outbox_ids(env) == {"full-fk-1", "full-fk-2", *behind}
    assert not delivered & (set(refused) | set(behind))
    assert checker.late_first_copies(deliveries) == []
    assert queue_depth(env, full_queue) == 1  # the filler; the queue took nothing
    assert relay.poll() is None
    assert stop(relay) == 0
