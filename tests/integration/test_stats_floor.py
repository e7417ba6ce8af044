"""The stats passes against real PostgreSQL (outbox_relay/runtime/stats.py; issue 36): a pass
from the floor counts what a full pass counts above it; a row that appears below both floors
(the stats' and the claims') is counted by the next full pass, which has the relay's claims
look from below it; the passes' thread and its own session, which reconnects when it is
cut and goes away with the relay."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

from devenv import checker
from outbox_relay import postgres
from outbox_relay.model import OutboxStats
from outbox_relay.relay.marks import ClaimMarks
from outbox_relay.relay.store import OutboxStore
from outbox_relay.relay.worker import Relay
from outbox_relay.resolver.metrics import ResolverMetrics
from outbox_relay.resolver.worker import Resolver
from outbox_relay.runtime import stats
from outbox_relay.tables import Tables
from tests.conftest import Env
from tests.integration.test_smoke_pipeline import make_relay

LOOK = 0.3  # the claims' full-look interval here: their floor moves within the test


def insert(conn: psycopg.Connection[Any], env: Env, count: int, prefix: str) -> list[int]:
    rows = conn.execute(sql.SQL(
        "INSERT INTO {} (message_id, exchange, routing_key, payload) "
        "SELECT %(p)s || n, %(e)s, %(r)s, jsonb_build_object('n', n) "
        "FROM generate_series(1, %(count)s) AS n RETURNING id").format(Tables(env.table).outbox),
        {"p": prefix, "e": env.exchange, "r": env.routing_key, "count": count}).fetchall()
    return sorted(row[0] for row in rows)


def pass_from(session: postgres.StatsSession, after: int) -> OutboxStats:
    return session.stats(after)


def backlog(relay: Relay) -> float:
    return relay.metrics.backlog._value.get()  # type: ignore[no-any-return]


def wait_for(what: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_pass_from_the_floor_counts_as_the_full_one_and_a_full_one_finds_a_low_id(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats, "FULL_STATS_INTERVAL", 3600.0)  # full passes when we say
    with env.connect() as conn:
        ids = insert(conn, env, 100, "row-")
    relay = make_relay(env, batch_size=10, stats_interval=3600)
    relay.store.marks = ClaimMarks(interval=LOOK)
    relay.ensure_connected()
    session = relay.store.stats_session()
    session.connect()
    try:
        relay._refresh_stats()  # the first pass: the whole table
        assert backlog(relay) == 100 and relay._stats_floor.floor == ids[0] - 1
        for _ in range(5):
            assert relay.run_batch() == 10
        relay.stats.next_at = 0.0
        relay._refresh_stats()  # from the floor: the rows published since are behind it
        floor = relay._stats_floor.floor
        assert backlog(relay) == 50 and floor == ids[50] - 1
        bounded, full = pass_from(session, floor), pass_from(session, 0)
        assert (bounded.backlog, bounded.never_due, bounded.lowest) == (
            full.backlog, full.never_due, full.lowest) == (50, 0, ids[50])
        assert abs(bounded.lag - full.lag) < 1.0
        # The bounded pass walks the primary key from the floor, never the whole table.
        with session.session.transaction():
            session.session.execute(postgres.BOUNDED_STATS_SETUP)
            plan = session.session.execute(
                sql.SQL("EXPLAIN (FORMAT JSON) ") + session.tables.query("stats"),
                postgres.stats_params(floor)).fetchone()
        assert plan is not None and "Seq Scan" not in str(plan[0]), plan

        time.sleep(LOOK)  # the next claim is a full look: the claims' floor moves up to 50
        while relay.run_batch():
            pass
        claims_floor = relay.store.marks.floor
        assert claims_floor >= ids[50] - 1, claims_floor
        relay.stats.next_at = 0.0
        relay._refresh_stats()
        assert backlog(relay) == 0

        # A row comes back below both floors (a restored row, or one of a late commit).
        low = ids[4]
        with env.connect() as conn:
            conn.execute(sql.SQL(
                "INSERT INTO {} (id, message_id, exchange, routing_key, payload) "
                "OVERRIDING SYSTEM VALUE VALUES (%s, 'low', %s, %s, '{{}}')").format(
                Tables(env.table).outbox), (low, env.exchange, env.routing_key))
        time.sleep(LOOK)
        assert relay.run_batch() == 0  # the claims' full look starts at their floor: not seen
        relay.stats.next_at = 0.0
        relay._refresh_stats()
        assert backlog(relay) == 0  # nor by a pass from the stats' floor
        monkeypatch.setattr(stats, "FULL_STATS_INTERVAL", 0.0)
        relay.stats.next_at = 0.0
        relay._refresh_stats()  # a full pass: counted, and the claims' floor lowered
        assert backlog(relay) == 1
        assert relay._stats_floor.floor == low - 1
        assert relay.run_batch() == 1
        assert relay.store.marks.floor <= low - 1
    finally:
        session.close()
        relay.close()
    delivered = checker.drain(env.amqp_url, env.queue, expected={"low"} | {
        f"row-{n}" for n in range(1, 101)})
    assert {d.message_id for d in delivered} >= {"low"}


def add_row(conn: psycopg.Connection[Any], tables: Tables, name: str, key: str | None = None,
            *, due_in: float = 0.0, attempts: int = 0) -> int:
    """One outbox row due ``due_in`` seconds from now; its id."""
    row = conn.execute(sql.SQL(
        "INSERT INTO {} (message_id, routing_key, ordering_key, payload, available_at,"
        " attempts) VALUES (%s, 'k', %s, '{{}}', now() + make_interval(secs => %s), %s)"
        " RETURNING id").format(tables.outbox), (name, key, due_in, attempts)).fetchone()
    assert row is not None
    return int(row[0])


def test_a_full_pass_puts_the_floor_past_the_rows_delayed_below_the_others(env: Env) -> None:
    """A scheduled event due tomorrow (its key or none) would keep the stats' floor below
    it, and every pass would walk from it (the dead entries a held snapshot keeps): the full
    pass gives the first other row as its lowest and counts the delayed ones below it."""
    tables = Tables(env.table)
    with env.connect() as conn:
        def add(name: str, *, due_in: float = 0.0, attempts: int = 0,
                key: str | None = None) -> int:
            return add_row(conn, tables, name, key, due_in=due_in, attempts=attempts)

        add("tomorrow", due_in=86400)
        add("keyed-tomorrow", due_in=86400, key="k")
        never = add("never", due_in=1e12)  # the year 10000 and later: dead-lettered, counted
        full = postgres.outbox_stats(conn, tables)
        assert (full.backlog, full.lowest, full.parked_below, full.never_due) == (3, never, 2, 1)
        conn.execute(sql.SQL("DELETE FROM {} WHERE id = %s").format(tables.outbox), (never,))
        retry = add("retry", due_in=86400, attempts=1)  # a retry is late: never passed
        due = add("due")
        full = postgres.outbox_stats(conn, tables)
        assert (full.backlog, full.lowest, full.parked_below) == (4, retry, 2)
        conn.execute(sql.SQL("DELETE FROM {} WHERE id IN (%s, %s)").format(tables.outbox),
                     (retry, due))
        last = add("later", due_in=3600)
        full = postgres.outbox_stats(conn, tables)  # all delayed: past the last
        assert (full.backlog, full.lowest, full.parked_below) == (3, last + 1, 3)
        assert postgres.outbox_stats(conn, tables, last).backlog == 0
        conn.execute(sql.SQL("DELETE FROM {}").format(tables.outbox))
        full = postgres.outbox_stats(conn, tables)
        assert (full.backlog, full.lowest, full.parked_below) == (0, None, 0)


def test_a_full_pass_puts_the_floor_past_a_dead_keys_rows_and_keeps_their_lag(
        env: Env) -> None:
    """Rows waiting behind a dead letter of their key (a poison event's) stay until someone
    requeues or discards it: the full pass passes them as it passes delayed rows, counts
    them, and gives how late the oldest is, which the passes in between keep exporting."""
    tables = Tables(env.table)
    with env.connect() as conn:
        def add(name: str, key: str | None, age: float = 0.0) -> int:
            row = conn.execute(sql.SQL(
                "INSERT INTO {} (message_id, routing_key, ordering_key, payload, created_at, "
                "available_at) VALUES (%s, 'k', %s, '{{}}', now() - make_interval(secs => %s), "
                "now() - make_interval(secs => %s)) RETURNING id"
            ).format(tables.outbox), (name, key, age, age)).fetchone()
            assert row is not None
            return int(row[0])

        conn.execute(sql.SQL(
            "INSERT INTO {} (message_id, exchange, routing_key, ordering_key, payload, headers,"
            " created_at, attempts, last_error) VALUES ('poison', '', 'k', 'dead', '{{}}', "
            "'{{}}', now(), 1, 'unroutable')").format(tables.dead_letter))
        add("dead-1", "dead", age=600)
        add("dead-2", "dead", age=500)
        first = add("live", "alive", age=5)
        full = postgres.outbox_stats(conn, tables)
        assert (full.backlog, full.lowest, full.parked_below) == (3, first, 2)
        assert full.lowest_unparked == first  # the claims' floor may stay past them too
        assert full.lag_below is not None and 600 <= full.lag_below < 660
        assert 600 <= full.lag < 660
        floor = stats.StatsFloor()
        floor.observe(full=True, lowest=full.lowest, parked=full.parked_below,
                      lag_below=full.lag_below)
        conn.execute(sql.SQL("DELETE FROM {} WHERE id = %s").format(tables.outbox), (first,))
        bounded = postgres.outbox_stats(conn, tables, first - 1)
        assert (bounded.backlog, bounded.lag) == (0, 0.0)
        assert floor.backlog(bounded.backlog, full=False) == 2
        assert floor.lag(bounded.lag, full=False) >= full.lag_below
        # Freed (its dead letter discarded): they count as any row at the next full pass.
        conn.execute(sql.SQL("DELETE FROM {}").format(tables.dead_letter))
        full = postgres.outbox_stats(conn, tables)
        assert (full.backlog, full.parked_below, full.lowest_unparked) == (2, 0, full.lowest)


def test_a_full_pass_puts_the_floor_past_a_key_held_behind_its_delayed_head(
        env: Env) -> None:
    """An event scheduled for tomorrow with an ordering key holds its key's later rows, due
    now: the full pass passes them too (the claims' floor does, holding the key), counts them,
    and names the key for the relay's check of the claims' floor; once the head is due
    within PARK_HORIZON, they count as any row."""
    tables = Tables(env.table)
    with env.connect() as conn:
        head = add_row(conn, tables, "head", "later", due_in=86400)
        add_row(conn, tables, "behind", "later")
        retried = add_row(conn, tables, "retried", "retry", due_in=86400, attempts=1)
        add_row(conn, tables, "behind-retry", "retry")
        live = add_row(conn, tables, "live", "alive")
        full = postgres.outbox_stats(conn, tables)
        # a retry is late: the stats pass it not (lowest), the claims' floor does (parked)
        assert (full.backlog, full.lowest, full.parked_below) == (5, retried, 2)
        assert full.lowest_unparked == live
        assert full.parked_keys == {"later": head, "retry": retried}
        assert full.lowest_parked_key == head
        conn.execute(sql.SQL("UPDATE {} SET available_at = now() + interval '1 s' "
                             "WHERE id = %s").format(tables.outbox), (head,))
        full = postgres.outbox_stats(conn, tables)
        assert (full.lowest, full.parked_below, full.lowest_unparked) == (head, 0, head)
        assert full.parked_keys == {}


def test_a_full_pass_answers_the_same_whatever_floor_it_is_given(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full pass reads the rows at or below the passes' floor by id, as its aggregate
    listed them, and walks from the floor (a held snapshot's dead entries behind a scheduled
    event are not walked); past MAX_LISTED such rows, it walks from the lowest row. Every
    floor, listed or not, gives what a pass from 0 gives."""
    tables = Tables(env.table)
    with env.connect() as conn:
        conn.execute(sql.SQL(
            "INSERT INTO {} (message_id, exchange, routing_key, ordering_key, payload, headers,"
            " created_at, attempts, last_error) VALUES ('poison', '', 'k', 'dead', '{{}}', "
            "'{{}}', now(), 1, 'unroutable')").format(tables.dead_letter))
        ids = [add_row(conn, tables, "tomorrow", due_in=86400),
               add_row(conn, tables, "head", "later", due_in=86400),
               add_row(conn, tables, "behind", "later"),
               add_row(conn, tables, "dead-key", "dead"),
               add_row(conn, tables, "retried", "retry", due_in=86400, attempts=1),
               add_row(conn, tables, "behind-retry", "retry"),
               add_row(conn, tables, "never", due_in=1e12),
               add_row(conn, tables, "due"),
               add_row(conn, tables, "alive", "alive"),
               add_row(conn, tables, "later-again", due_in=3600)]

        def shape(found: OutboxStats) -> tuple[Any, ...]:
            return (found.backlog, found.never_due, found.lowest, found.lowest_unparked,
                    found.parked_below, found.parked_keys, found.lowest_parked_key,
                    found.lag_below is None)

        expected = postgres.outbox_stats(conn, tables)
        assert (expected.lowest, expected.lowest_unparked, expected.parked_below) == (
            ids[4], ids[7], 4)
        for max_listed in (postgres.MAX_LISTED, 1):
            monkeypatch.setattr(postgres, "MAX_LISTED", max_listed)
            for floor in range(ids[0] - 1, ids[-1] + 2):
                found = postgres.outbox_stats(conn, tables, 0, floor)
                assert shape(found) == shape(expected), (max_listed, floor)
                assert abs(found.lag - expected.lag) < 5.0
        # A row that comes back below the floor is read: it lowers what the pass gives.
        conn.execute(sql.SQL("UPDATE {} SET available_at = now() WHERE id = %s").format(
            tables.outbox), (ids[0],))
        for max_listed in (1, 100):
            monkeypatch.setattr(postgres, "MAX_LISTED", max_listed)
            found = postgres.outbox_stats(conn, tables, 0, ids[-1])
            assert (found.lowest, found.lowest_unparked, found.parked_below) == (
                ids[0], ids[0], 0)


def stats_backends(env: Env, name: str) -> int:
    with env.connect() as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                           (name,)).fetchone()
    assert row is not None
    return int(row[0])


def test_the_relays_stats_thread_reconnects_its_own_session_and_ends_with_the_relay(
        env: Env, caplog: pytest.LogCaptureFixture) -> None:
    name = f"test-{env.gid_prefix}"
    with env.connect() as conn:
        insert(conn, env, 30, "t-")
    settings = env.relay_settings(stats_interval=0.05)
    relay = make_relay(env, background_stats=True, stats_interval=0.05)
    relay.store = OutboxStore(settings.database_url, settings.table, application_name=name)
    relay.stats.start()
    try:
        wait_for(lambda: backlog(relay) == 30)
        assert stats_backends(env, f"{name} stats") == 1
        assert stats_backends(env, name) == 0  # the relay's own sessions are not needed
        with caplog.at_level(logging.WARNING, logger="relay"), env.connect() as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE application_name = %s", (f"{name} stats",))
            insert(conn, env, 5, "u-")
            wait_for(lambda: backlog(relay) == 35)  # a new session, after the backoff
        assert [getattr(r, "action", "") for r in caplog.records] == ["stats_failed"]
    finally:
        relay.close()
    assert not relay.stats.running
    wait_for(lambda: stats_backends(env, f"{name} stats") == 0)


def test_the_resolvers_stats_thread_sets_its_gauges(env: Env) -> None:
    with env.connect() as conn:
        insert(conn, env, 12, "r-")
    metrics = ResolverMetrics()
    resolver = Resolver(env.resolver_settings(stats_interval=0.05), metrics=metrics)
    resolver.stats.start()
    try:
        wait_for(lambda: metrics.backlog._value.get() == 12)
        assert metrics.blocked_keys._value.get() == 0
    finally:
        resolver.stats.stop()
        resolver.close()
    assert not resolver.stats.running
