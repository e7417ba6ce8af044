"""Rows that cannot be delivered end in the dead-letter table; the healthy rows keep flowing."""

from __future__ import annotations

from typing import Any

from psycopg import sql
from psycopg.types.json import Jsonb

from devenv import checker
from outbox_relay.tables import Tables
from tests.conftest import Env
from tests.integration.test_smoke_pipeline import make_relay


def insert_row(env: Env, **columns: Any) -> None:
    columns.setdefault("payload", Jsonb({"poison": True}))
    names = sql.SQL(", ").join(sql.Identifier(c) for c in columns)
    values = sql.SQL(", ").join(sql.Placeholder() for _ in columns)
    with env.connect() as conn:
        conn.execute(sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
            Tables(env.table).outbox, names, values), list(columns.values()))


def dead_letters(env: Env) -> dict[str, tuple[int, str]]:
    with env.connect() as conn:
        rows = conn.execute(sql.SQL("SELECT message_id, attempts, last_error FROM {}").format(
            Tables(env.table).dead_letter)).fetchall()
    return {r[0]: (r[1], r[2]) for r in rows}


def run_until_empty(env: Env, relay: Any, *, rounds: int = 400) -> None:
    with env.connect() as conn:
        for _ in range(rounds):
            relay.ensure_connected()  # as the loop does before every batch
            relay.run_batch()
            row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(
                Tables(env.table).outbox)).fetchone()
            if row and row[0] == 0:
                return
            relay.publisher.idle(0.02)
    raise AssertionError("rows left in the outbox")


def test_unroutable_and_missing_exchange_are_dead_lettered_after_the_attempt_limit(
    env: Env,
) -> None:
    with env.connect() as conn:
        head = checker.insert_events(conn, env.table, 300, exchange=env.exchange,
                                     routing_key=env.routing_key, prefix="head")
    insert_row(env, message_id="unroutable-1", exchange="", routing_key="no.such.queue")
    insert_row(env, message_id="missing-exchange-1", exchange="no.such.exchange",
               routing_key="x")
    with env.connect() as conn:
        tail = checker.insert_events(conn, env.table, 300, exchange=env.exchange,
                                     routing_key=env.routing_key, prefix="tail")
    relay = make_relay(env, batch_size=100, max_attempts=3)
    run_until_empty(env, relay)
    relay.close()

    dead = dead_letters(env)
    assert set(dead) == {"unroutable-1", "missing-exchange-1"}
    assert dead["unroutable-1"][0] == 3 and "unroutable" in dead["unroutable-1"][1]
    assert dead["missing-exchange-1"][0] == 3 and "not found" in dead["missing-exchange-1"][1]
    produced = head + tail
    report = env.drain_and_check(produced)
    # The healthy rows of the failed batches were delivered once, not again on every retry.
    assert report.ok(dead_letter_expected=2), report.summary()
    assert relay.metrics.dead_lettered.labels("exhausted")._value.get() == 2


def test_rows_that_can_never_be_published_are_dead_lettered_at_once(env: Env) -> None:
    insert_row(env, message_id="bad-headers", exchange=env.exchange, routing_key="a",
               headers=Jsonb(["not", "an", "object"]))
    insert_row(env, message_id="huge-int-header", exchange=env.exchange, routing_key="a",
               headers=Jsonb({"n": 2**70}))
    insert_row(env, message_id="too-big", exchange=env.exchange, routing_key="a",
               payload=None, payload_bytes=b"x" * 5000)
    insert_row(env, message_id="fine", exchange=env.exchange, routing_key="a",
               payload=None, payload_bytes=b"\x00\x01raw")
    relay = make_relay(env, max_message_bytes=4096)
    run_until_empty(env, relay)
    relay.close()
    dead = dead_letters(env)
    assert set(dead) == {"bad-headers", "huge-int-header", "too-big"}
    assert "JSON object" in dead["bad-headers"][1]
    assert "exceeds" in dead["too-big"][1]
    deliveries = checker.drain(env.amqp_url, env.queue, expected={"fine"})
    assert [d.message_id for d in deliveries] == ["fine"]
