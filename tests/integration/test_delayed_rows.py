"""Rows a producer delays (available_at): the lag counts them from when they are due, and a row
never due ('infinity', the year 10000 or later) goes to the dead-letter table instead of holding
its key forever unseen (issue 32)."""

from __future__ import annotations

import subprocess
from typing import Any

import psycopg
from psycopg import sql

from devenv import checker, launch
from outbox_relay.model import OutboxStats
from outbox_relay.relay.worker import Relay
from outbox_relay.resolver.store import blocked_keys
from outbox_relay.tables import Tables
from tests.conftest import Env
from tests.integration.test_smoke_pipeline import make_relay

HOUR = 3600.0


def insert(conn: psycopg.Connection[Any], env: Env, message_id: str, *, key: str | None = None,
           created: str = "0 s", available: str = "0 s", at: str | None = None,
           attempts: int = 0) -> None:
    """A row created ``created`` ago and due ``available`` ago ('-1 hour': in an hour), or
    at ``at`` (a timestamptz literal: 'infinity')."""
    due = (sql.SQL("now() - %(available)s::interval") if at is None
           else sql.SQL("%(at)s::timestamptz"))
    conn.execute(sql.SQL(
        "INSERT INTO {} (message_id, exchange, routing_key, ordering_key, payload, created_at, "
        "available_at, attempts) VALUES (%(m)s, %(e)s, %(r)s, %(k)s, jsonb_build_object('m', "
        "%(m)s::text), now() - %(created)s::interval, {}, %(attempts)s)").format(
        Tables(env.table).outbox, due),
        {"m": message_id, "e": env.exchange, "r": env.routing_key, "k": key, "created": created,
         "available": available, "at": at, "attempts": attempts})


def full_stats(relay: Relay) -> OutboxStats:
    """A full stats pass (the whole table), on a stats session of the relay's."""
    session = relay.store.stats_session()
    session.connect()
    try:
        return session.stats(0)
    finally:
        session.close()


def lag(relay: Relay) -> float:
    return full_stats(relay).lag


def test_the_lag_counts_a_row_from_when_it_is_due(env: Env) -> None:
    relay = make_relay(env)
    relay.ensure_connected()  # no batch is run: the rows stay
    try:
        with env.connect() as conn:
            # Delayed on purpose, not due yet: not late (it fired OutboxLagHigh before).
            insert(conn, env, "later", created="2 hours", available="-1 hour")
            insert(conn, env, "never", at="infinity")
            stats = full_stats(relay)
            assert (stats.backlog, stats.lag, stats.never_due) == (2, 0.0, 1)
            # Due an hour ago, created two hours ago: an hour late.
            insert(conn, env, "due", created="2 hours", available="1 hour")
            assert HOUR - 60 < lag(relay) < HOUR + 60
            # Failed before, waiting for its retry: late since it was created.
            insert(conn, env, "retry", created="3 hours", available="-5 minutes", attempts=2)
            assert 3 * HOUR - 60 < lag(relay) < 3 * HOUR + 60
    finally:
        relay.close()


def test_a_due_row_behind_a_delayed_row_of_its_key_is_late(env: Env) -> None:
    relay = make_relay(env)
    relay.ensure_connected()
    try:
        with env.connect() as conn:
            insert(conn, env, "k-1", key="k", created="1 hour", available="-1 hour")
            insert(conn, env, "k-2", key="k", created="1 hour", available="1 hour")
            # Its consumers wait for it (per-key order holds it behind k-1): counted.
            assert HOUR - 60 < lag(relay) < HOUR + 60
    finally:
        relay.close()


def dead_letters(env: Env) -> dict[str, str]:
    with env.connect() as conn:
        rows = conn.execute(sql.SQL("SELECT message_id, last_error FROM {}").format(
            Tables(env.table).dead_letter)).fetchall()
    return {r[0]: r[1] for r in rows}


def outbox_ids(env: Env) -> list[str]:
    with env.connect() as conn:
        rows = conn.execute(sql.SQL("SELECT message_id FROM {} ORDER BY id").format(
            Tables(env.table).outbox)).fetchall()
    return [r[0] for r in rows]


def turns(relay: Relay, n: int) -> None:
    for _ in range(n):
        relay.turn()  # a batch, then the stats (and the sweep they may call for)


def test_a_row_never_due_is_dead_lettered_and_its_key_shows_as_blocked(env: Env) -> None:
    with env.connect() as conn:
        insert(conn, env, "a-1", key="a")
        insert(conn, env, "a-2", key="a", at="infinity")  # not the key's head yet
        insert(conn, env, "a-3", key="a")
        insert(conn, env, "b-1", key="b", at="10000-01-01 00:00:00+00")
        insert(conn, env, "b-2", key="b")
        insert(conn, env, "keyless", at="infinity")
        insert(conn, env, "c-1", key="c")
        insert(conn, env, "scheduled", key="d", available="-1 hour")  # honoured: a schedule
    relay = make_relay(env, stats_interval=0.001)
    try:
        turns(relay, 6)
        # a-2 went only once a-1 was published (it held nothing back before); b-1 and the
        # keyless row at once. Their keys' later rows wait behind the dead letters.
        dead = dead_letters(env)
        assert set(dead) == {"a-2", "b-1", "keyless"}, dead
        assert dead["a-2"] == ("available_at 'infinity' is never due (a date before the year "
                               "10000 is required)")
        assert dead["b-1"].startswith("available_at '10000-01-01 00:00:00")
        assert outbox_ids(env) == ["a-3", "b-2", "scheduled"]
        with env.connect() as conn:
            assert blocked_keys(conn, Tables(env.table)) == 2  # a and b: outbox_blocked_keys
        assert relay.metrics.dead_lettered.labels("invalid")._value.get() == 3
        delivered = checker.drain(env.amqp_url, env.queue, expected={"a-1", "c-1"})
        assert sorted(d.message_id for d in delivered) == ["a-1", "c-1"]
    finally:
        relay.close()


def test_a_requeued_never_due_row_is_published_first_of_its_key(env: Env) -> None:
    with env.connect() as conn:
        insert(conn, env, "a-1", key="a", at="infinity")
        insert(conn, env, "a-2", key="a")
    relay = make_relay(env, stats_interval=0.001)
    try:
        turns(relay, 3)
        assert set(dead_letters(env)) == {"a-1"} and outbox_ids(env) == ["a-2"]
        result = subprocess.run(launch.command("relay", "dead-letter", "requeue", "--all"),
                                env=env.cli_env(), capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        turns(relay, 3)  # requeued due now (available_at = now()), with its old id: first
        assert outbox_ids(env) == [] and dead_letters(env) == {}
        delivered = checker.drain(env.amqp_url, env.queue, expected={"a-1", "a-2"})
        assert [d.message_id for d in delivered] == ["a-1", "a-2"]
    finally:
        relay.close()
