"""Per-key order on real servers: the claim holds a key back behind a batch in flight, a retry
or a dead letter, and never lets a held-back key fill a batch (sql/queries.sql)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from devenv import checker
from outbox_relay.errors import StartupCheckError
from outbox_relay.relay.dead_letter import requeue
from outbox_relay.relay.marks import FULL_LOOK_INTERVAL
from outbox_relay.relay.store import OutboxStore
from outbox_relay.resolver.store import blocked_keys
from outbox_relay.tables import Tables
from tests.conftest import Env
from tests.integration.test_pipeline import json_lines, log_of, outbox_count, stop, wait_until

pytestmark = pytest.mark.core  # run on every tested PostgreSQL (CONTRIBUTING.md)

BUDGET = 16 << 20


def insert(conn: psycopg.Connection[Any], table: str, keys: list[str | None]) -> list[int]:
    """One row per key given (None: no key), in one transaction; their ids in order."""
    rows = conn.execute(sql.SQL(
        "INSERT INTO {} (routing_key, ordering_key, payload) "
        "SELECT 'r', k, jsonb_build_object('n', n) FROM unnest(%s::text[]) "
        "WITH ORDINALITY AS u(k, n) ORDER BY n RETURNING id").format(Tables(table).outbox),
        (keys,)).fetchall()
    return sorted(row[0] for row in rows)


@pytest.fixture
def stores(env: Env) -> Iterator[list[OutboxStore]]:
    """Two relays' stores on the test's table."""
    made = [OutboxStore(env.db_url, env.table) for _ in range(2)]
    for n, store in enumerate(made):
        store.connect(lock_class=7, instance=0x0D00 + n)
    yield made
    for store in made:
        store.close()


def claimed(store: OutboxStore, limit: int = 100) -> list[tuple[int, str | None]]:
    return [(row.id, row.ordering_key) for row in store.claim(limit, BUDGET)]


def test_a_key_in_a_prepared_batch_waits_for_it_while_other_keys_flow(
        env: Env, stores: list[OutboxStore]) -> None:
    first, second = stores
    with env.connect() as conn:
        a1, a2, b1 = insert(conn, env.table, ["a", "a", "b"])
        assert claimed(first, limit=1) == [(a1, "a")]
        first.prepare(f"{env.gid_prefix}:order:1")
        a3, b2, free = insert(conn, env.table, ["a", "b", None])
        # a1 is deleted by a prepared transaction, still visible: a's later rows wait for it.
        assert claimed(second) == [(b1, "b"), (b2, "b"), (free, None)]
        second.rollback()
        assert first.finish(f"{env.gid_prefix}:order:1", commit=True)
        assert claimed(second) == [(a2, "a"), (b1, "b"), (a3, "a"), (b2, "b"), (free, None)]
        second.rollback()


def locked_by_others(conn: psycopg.Connection[Any], table: str) -> list[int]:
    """The outbox rows some other transaction holds (locked, or deleted by a batch)."""
    with conn.transaction(force_rollback=True):
        free = {row[0] for row in conn.execute(sql.SQL(
            "SELECT id FROM {} FOR UPDATE SKIP LOCKED").format(Tables(table).outbox))}
        every = {row[0] for row in conn.execute(sql.SQL("SELECT id FROM {}").format(
            Tables(table).outbox))}
    return sorted(every - free)


def test_rows_behind_a_batch_in_flight_are_stepped_over_without_locking_them(
        env: Env, stores: list[OutboxStore]) -> None:
    first, second = stores
    with env.connect() as conn:
        held, *behind = insert(conn, env.table, ["a"] * 11)
        others = insert(conn, env.table, [f"k{n}" for n in range(10)])
        assert claimed(first, limit=1) == [(held, "a")]
        first.prepare(f"{env.gid_prefix}:order:1")
        # a's rows come first in id order, and wait for the prepared batch: the next claim
        # takes a full batch of the other keys, and leaves a's rows unlocked.
        assert [i for i, _ in claimed(second, limit=10)] == others
        assert locked_by_others(conn, env.table) == [held, *others]
        second.rollback()
        # A claim looks at three times the rows it asks for, past the rows in flight: with
        # more of a's rows than that ahead, it returns none rather than read the backlog.
        assert claimed(second, limit=3) == []
        second.rollback()
        assert first.finish(f"{env.gid_prefix}:order:1", commit=True)
        assert [i for i, _ in claimed(second, limit=3)] == behind[:3]
        second.rollback()


def test_two_relays_racing_for_one_key_never_split_it(
        env: Env, stores: list[OutboxStore]) -> None:
    first, second = stores
    with env.connect() as conn:
        ids = insert(conn, env.table, ["a"] * 6)
        # The first locks the key's oldest rows; the second, claiming at once, gets nothing of
        # the key: its oldest row is not the second's (whichever order the locks are taken in).
        assert [i for i, _ in claimed(first, limit=3)] == ids[:3]
        assert claimed(second) == []
        second.rollback()
        first.rollback()
        assert [i for i, _ in claimed(second)] == ids
        second.rollback()


def test_a_row_waiting_for_its_retry_holds_back_its_key_only(
        env: Env, stores: list[OutboxStore]) -> None:
    store = stores[0]
    tables = Tables(env.table)
    with env.connect() as conn:
        a1, b1, _a2, b2 = insert(conn, env.table, ["a", "b", "a", "b"])
        conn.execute(sql.SQL("UPDATE {} SET attempts = 1, available_at = now() + '1 hour' "
                             "WHERE id = %s").format(tables.outbox), (a1,))
        assert claimed(store) == [(b1, "b"), (b2, "b")]
        store.rollback()
        conn.execute(sql.SQL("UPDATE {} SET available_at = now() WHERE id = %s").format(
            tables.outbox), (a1,))
        assert claimed(store) == [(a1, "a")]  # the retry, alone
        store.rollback()


def test_a_dead_letter_holds_back_its_key_until_it_is_discarded(
        env: Env, stores: list[OutboxStore]) -> None:
    store = stores[0]
    tables = Tables(env.table)
    with env.connect() as conn:
        # A hot key behind a dead letter, ahead of everything else in id order: the claim steps
        # over it without locking it, so it never fills a batch.
        conn.execute(sql.SQL(
            "INSERT INTO {} (message_id, exchange, routing_key, ordering_key, payload, headers, "
            "created_at, attempts, last_error) VALUES "
            "('dead', '', 'r', 'hot', '{{}}', '{{}}', now(), 3, 'nacked')").format(
            tables.dead_letter))
        hot = insert(conn, env.table, ["hot"] * 500)
        others = insert(conn, env.table, [f"k{n}" for n in range(20)])
        assert [i for i, _ in claimed(store, limit=20)] == others
        store.rollback()
        assert blocked_keys(conn, tables) == 1  # the resolver's outbox_blocked_keys
        conn.execute(sql.SQL("DELETE FROM {}").format(tables.dead_letter))
        assert blocked_keys(conn, tables) == 0
        # The claims' floor passed the dead key's rows (relay/marks.py): the next look from
        # the floor sees the key free, and the claim after it starts below its rows.
        time.sleep(FULL_LOOK_INTERVAL)
        assert [i for i, _ in claimed(store, limit=20)] == others
        store.rollback()
        assert [i for i, _ in claimed(store, limit=20)] == hot[:20]
        store.rollback()


def test_the_relay_refuses_to_start_without_the_key_indexes(env: Env) -> None:
    tables = Tables(env.table)
    with env.connect() as conn:
        conn.execute(sql.SQL("DROP INDEX {}").format(tables.key_indexes[0]))
    store = OutboxStore(env.db_url, env.table)
    with pytest.raises(StartupCheckError, match="run `outbox-relay migrate`"):
        store.connect(lock_class=7, instance=0x0D10)
    store.close()


def test_four_relays_keep_the_order_of_50_keys_with_failures_on_the_way(env: Env) -> None:
    """Rows of one key routed to nowhere fail and are retried (the queue's binding comes later):
    they hold back their key, and the first delivery of every event is in id order per key."""
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 3000, exchange=env.exchange,
                                         routing_key=env.routing_key, keys=50)
        # Every 7th event of key k3 goes to a routing key nothing is bound to yet.
        conn.execute(sql.SQL(
            "UPDATE {} SET routing_key = 'late' WHERE ordering_key = 'k3' AND id % 7 = 0").format(
            Tables(env.table).outbox))
    amqp, channel = env.amqp_channel()
    channel.queue_bind(env.queue, env.exchange, routing_key=env.routing_key)
    channel.queue_unbind(env.queue, env.exchange, routing_key="#")
    relays = [env.spawn("relay", OUTBOX_BATCH_SIZE="100", OUTBOX_MAX_ATTEMPTS="1000",
                        OUTBOX_LOG_FORMAT="json") for _ in range(4)]
    outbox = Tables(env.table).outbox
    with env.connect() as conn:
        # Every other key flows; k3 is held back behind its first unroutable row.
        k3 = sql.SQL("SELECT count(*) FROM {} WHERE ordering_key = 'k3'").format(outbox)
        wait_until(lambda: outbox_count(env) == conn.execute(k3).fetchone()[0], 60,  # type: ignore[index]
                   "every key but k3 to drain")
        head = conn.execute(sql.SQL("SELECT routing_key, attempts > 0 FROM {} "
                                    "WHERE ordering_key = 'k3' ORDER BY id LIMIT 1").format(
                                        outbox)).fetchone()
        assert head == ("late", True)
    channel.queue_bind(env.queue, env.exchange, routing_key="late")
    amqp.close()
    wait_until(lambda: outbox_count(env) == 0, 120, "the outbox to empty")
    for proc in relays:
        assert stop(proc) == 0
    report = env.drain_and_check(produced)
    # A batch that failed in part is rolled back and its confirmed rows are forgotten just after;
    # another relay may republish them in between (docs/protocol.md), in a batch that can fail
    # again if it took the unroutable row before its failure was recorded. So each rolled-back
    # batch adds at most its size less its failed row; later tries of k3's head are claimed alone.
    rolled_back = [line["batch_size"] for proc in relays for line in json_lines(log_of(proc))
                   if line["action"] == "batch_rolled_back"]
    assert rolled_back, "the unroutable row never failed"
    assert report.ok(max_duplicates=sum(size - 1 for size in rolled_back)), (
        report.summary(), rolled_back)
    assert not report.order_violations


def test_requeue_gives_a_keyed_row_its_old_id_back_and_it_goes_first(
        env: Env, stores: list[OutboxStore]) -> None:
    tables = Tables(env.table)
    with env.connect() as conn:
        a1, a2, free = insert(conn, env.table, ["a", "a", None])
        # a1 and the keyless row as the relay dead-letters them (moved, with their outbox ids).
        conn.execute(sql.SQL(
            "WITH moved AS (DELETE FROM {} WHERE id = ANY(%s) RETURNING *) "
            "INSERT INTO {} (outbox_id, message_id, exchange, routing_key, ordering_key, payload, "
            "headers, created_at, attempts, last_error) "
            "SELECT id, message_id, exchange, routing_key, ordering_key, payload, headers, "
            "created_at, 3, 'unroutable' FROM moved").format(tables.outbox, tables.dead_letter),
            ([a1, free],))
        assert claimed(stores[0]) == []  # a2 waits behind its key's dead letter
        stores[0].rollback()
        result = requeue(conn, tables, None)
        assert sorted(result.moved.values())[0] == a1  # its old id
        assert max(result.moved.values()) > a2  # the keyless row: a new one
        assert [i for i, _ in claimed(stores[0])] == [a1, a2, max(result.moved.values())]
        stores[0].rollback()
