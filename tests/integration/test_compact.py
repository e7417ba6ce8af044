"""`outbox-relay compact` against real PostgreSQL (outbox_relay/compact.py; issue 36): it
gives back the heap and index pages VACUUM keeps, loses and changes no row, and keeps writers
waiting no longer than its bounds, also when it cannot run (a prepared batch holds the table,
a rewrite takes too long): then it changes nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import sql

from outbox_relay import compact
from outbox_relay.postgres import connect_pinned
from outbox_relay.relay.store import OutboxStore
from outbox_relay.resolver.metrics import ResolverMetrics
from outbox_relay.resolver.worker import Resolver
from outbox_relay.tables import Tables
from tests.conftest import Env, finish_env, make_env
from tests.integration.test_pipeline import log_of, outbox_count, stop, wait_until
from tests.integration.test_roles import run_cli


def fill(env: Env, total: int, keep: int) -> None:
    """``total`` rows, all deleted but the newest ``keep``: the state a held snapshot leaves
    once it ends (a plain VACUUM frees the dead rows' space, and cannot cut a tail that holds
    live rows)."""
    outbox = Tables(env.table).outbox
    with psycopg.connect(env.db_url, autocommit=True) as conn:
        conn.execute(sql.SQL(
            "INSERT INTO {} (message_id, exchange, routing_key, ordering_key, payload) "
            "SELECT 'm' || n, %(e)s, 'k', 'key-' || n %% 50, jsonb_build_object('n', n, 'pad', "
            "repeat('x', 200)) FROM generate_series(1, %(total)s) AS n").format(outbox),
            {"e": env.exchange, "total": total})
        conn.execute(sql.SQL("DELETE FROM {} WHERE id <= (SELECT max(id) FROM {}) - %s").format(
            outbox, outbox), (keep,))


def rows(env: Env) -> list[tuple[Any, ...]]:
    with psycopg.connect(env.db_url, autocommit=True) as conn:
        return conn.execute(sql.SQL(
            "SELECT id, message_id, ordering_key, payload FROM {} ORDER BY id").format(
            Tables(env.table).outbox)).fetchall()


def sizes(env: Env) -> compact.Sizes:
    conn, tables = connect_pinned(env.db_url, env.table, timeout=10, application_name="test")
    with conn:
        return compact.Sizes.read(conn, tables)


def index_state(env: Env) -> list[tuple[str, bool, bool]]:
    """The outbox's indexes: name, valid, marked by CLUSTER."""
    with psycopg.connect(env.db_url, autocommit=True) as conn:
        return [(name, valid, clustered) for name, valid, clustered in conn.execute(
            "SELECT i.relname, x.indisvalid, x.indisclustered FROM pg_index AS x "
            "JOIN pg_class AS i ON i.oid = x.indexrelid WHERE x.indrelid = %s::regclass "
            "ORDER BY 1", (Tables(env.table).outbox.as_string(None),)).fetchall()]


def compact_now(env: Env) -> compact.Compacted:
    conn, tables = connect_pinned(env.db_url, env.table, timeout=10, application_name="t")
    with conn:
        return compact.compact(conn, tables, lock_timeout=0.1, max_block=2, attempts=3)


class Writer(threading.Thread):
    """A producer inserting one row per transaction until stopped; its slowest INSERT."""

    def __init__(self, env: Env) -> None:
        super().__init__(daemon=True)
        self.env = env
        self.stop = threading.Event()
        self.slowest = 0.0
        self.count = 0

    def run(self) -> None:
        statement = sql.SQL("INSERT INTO {} (exchange, routing_key, payload) "
                            "VALUES (%s, 'k', '{{}}')").format(Tables(self.env.table).outbox)
        with psycopg.connect(self.env.db_url, autocommit=True) as conn:
            while not self.stop.is_set():
                started = time.monotonic()
                conn.execute(statement, (self.env.exchange,))
                self.slowest = max(self.slowest, time.monotonic() - started)
                self.count += 1
                time.sleep(0.002)


@pytest.fixture
def own_db_env(env: Env) -> Iterator[Env]:
    """``env`` in a database of its own: a snapshot another test holds in the shared database
    (test_xmin_horizon, the benchmark's smoke) would keep its dead rows, and the rewrite would
    copy them."""
    name = f"compact_{env.gid_prefix}"
    with psycopg.connect(env.db_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    own = make_env(urlsplit(env.db_url)._replace(path=f"/{name}").geturl(), env.amqp_url)
    try:
        yield own
    finally:
        finish_env(own, drop=False)
        with psycopg.connect(env.db_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def test_compact_gives_back_the_pages_and_keeps_every_row(own_db_env: Env) -> None:
    env = own_db_env
    fill(env, 200_000, keep=300)
    with psycopg.connect(env.db_url, autocommit=True) as conn:
        conn.execute(sql.SQL("VACUUM {}").format(Tables(env.table).outbox))
    kept = rows(env)
    before = sizes(env)
    assert before.heap_bytes > 40 * 1024**2  # the pages VACUUM keeps
    indexes_before = index_state(env)
    assert all(valid and not clustered for _, valid, clustered in indexes_before)

    dry = run_cli(env, "relay", "compact", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "this role may compact it" in dry.stdout
    assert sizes(env).heap_bytes == before.heap_bytes  # --dry-run changed nothing

    writer = Writer(env)
    writer.start()
    try:
        time.sleep(0.3)
        done = run_cli(env, "relay", "compact", "--log-format", "json")
        time.sleep(0.3)
    finally:
        writer.stop.set()
        writer.join()
    assert done.returncode == 0, done.stderr
    assert '"action": "compacted"' in done.stderr
    assert '"indexes_rebuilt_concurrently": true' in done.stderr
    # The indexes rebuilt by their names, valid, none left behind; CLUSTER's mark taken back.
    assert index_state(env) == indexes_before

    after = sizes(env)
    assert after.heap_bytes < before.heap_bytes / 20
    assert after.index_bytes < before.index_bytes / 10
    now = rows(env)
    assert now[:len(kept)] == kept  # every row kept, unchanged, in place
    assert len(now) == len(kept) + writer.count  # and every row written meanwhile
    assert writer.count > 0
    # The writer waited on the rewrite no longer than its bounds (defaults: 0.1 s for the lock,
    # 2 s for the rewrite), plus room for a slow machine's commit.
    assert writer.slowest < 0.1 + 2 + 1


def test_compact_waits_out_a_prepared_batch_then_gives_up_changing_nothing(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compact, "RETRY_PAUSE", 0.05)
    monkeypatch.setattr(compact, "REBUILD_TIMEOUT", 0.5)  # it waits for the batch too
    fill(env, 20_000, keep=10)
    outbox = Tables(env.table).outbox
    gid = f"{env.gid_prefix}:compact-test"
    with psycopg.connect(env.db_url) as batch:  # a relay's batch, prepared (or in doubt)
        batch.execute(sql.SQL("DELETE FROM {} WHERE id = (SELECT max(id) FROM {})").format(
            outbox, outbox))
        batch.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
    try:
        before = sizes(env)
        writer = Writer(env)
        writer.start()
        conn, tables = connect_pinned(env.db_url, env.table, timeout=10, application_name="t")
        try:
            with conn, pytest.raises(compact.CompactFailed, match="never free"):
                compact.compact(conn, tables, lock_timeout=0.05, max_block=2, attempts=5)
        finally:
            writer.stop.set()
            writer.join()
        assert writer.count > 0
        assert writer.slowest < 0.05 + 1  # each attempt queued writers for lock_timeout at most
        assert sizes(env).heap_bytes >= before.heap_bytes  # not rewritten
        # The concurrent rebuild waited for the batch too, and left its invalid new indexes
        # (which it could not drop either, the batch still there).
        assert any(not valid and "_ccnew" in name for name, valid, _ in index_state(env))
    finally:
        with psycopg.connect(env.db_url, autocommit=True) as conn:
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
    assert len(rows(env)) == 10 + writer.count  # the batch's row is back: nothing lost
    # The next compaction drops those leftovers first, and runs.
    done = compact_now(env)
    assert done.rebuilt_concurrently
    assert all(valid and "_cc" not in name for name, valid, _ in index_state(env))


def test_an_index_marked_by_cluster_keeps_its_mark(env: Env) -> None:
    """The rewrite is a CLUSTER on the primary key: the mark an operator set stays."""
    fill(env, 20_000, keep=10)
    marked = f"{env.table}_message_id_key"
    with psycopg.connect(env.db_url, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER TABLE {} CLUSTER ON {}").format(
            Tables(env.table).outbox, sql.Identifier(marked)))
    kept = rows(env)
    done = compact_now(env)
    assert done.after.heap_bytes < done.before.heap_bytes
    assert rows(env) == kept
    assert [name for name, _, clustered in index_state(env) if clustered] == [marked]


def test_a_rewrite_past_max_block_is_rolled_back(env: Env) -> None:
    fill(env, 100_000, keep=100_000)  # a large backlog: nothing dead, everything to copy
    kept = rows(env)
    before = sizes(env)
    conn, tables = connect_pinned(env.db_url, env.table, timeout=10, application_name="t")
    with conn:
        with pytest.raises(compact.CompactFailed, match="OUTBOX_COMPACT_MAX_BLOCK"):
            # Below a millisecond each: still 1 ms, never 0 (which would turn them off).
            compact.compact(conn, tables, lock_timeout=0.0001, max_block=0.0001, attempts=1)
        # The session's timeouts are its own again.
        assert conn.execute("SHOW statement_timeout").fetchone() == ("0",)
    assert rows(env) == kept
    assert sizes(env).heap_bytes == before.heap_bytes


def test_compact_of_a_missing_table_exits_3_with_one_line(env: Env) -> None:
    done = run_cli(env, "relay", "compact", OUTBOX_TABLE=f"{env.table}_missing")
    assert done.returncode == 3
    assert "does not exist: run outbox-relay migrate first" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_resolver_compacts_once_a_held_snapshot_has_ended(own_db_env: Env) -> None:
    """The sidecar's own compaction (resolver/compaction.py): nothing while the snapshot is
    held, the pages back at the first stats pass after it ended, every row kept, once."""
    env = own_db_env
    metrics = ResolverMetrics()
    resolver = Resolver(env.resolver_settings(compact_after_hold=0.5, compact_above=1,
                                              hard_limit=3600),
                        metrics=metrics, background_stats=False)

    def scan() -> None:
        resolver.stats.next_at = 0.0  # a stats pass at every scan
        resolver.resolve_once()

    def compactions(outcome: str) -> float | None:
        return metrics.registry.get_sample_value("outbox_resolver_compactions_total",
                                                 {"outcome": outcome})

    try:
        with env.connect() as holder:
            holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT 1")  # the snapshot is taken: VACUUM keeps what is deleted
            fill(env, 200_000, keep=300)
            time.sleep(0.6)
            scan()
            scan()
            assert compactions("compacted") == 0  # not while it is held
            before = sizes(env)
            assert before.heap_bytes > 40 * 1024**2 and before.dead_rows > 100_000
            holder.execute("COMMIT")
        kept = rows(env)
        writer = Writer(env)
        writer.start()
        try:
            time.sleep(0.2)
            scan()
            time.sleep(0.2)
        finally:
            writer.stop.set()
            writer.join()
        assert compactions("compacted") == 1
        after = sizes(env)
        assert after.heap_bytes < before.heap_bytes / 20
        assert after.index_bytes < before.index_bytes / 10
        now = rows(env)
        assert now[:len(kept)] == kept and len(now) == len(kept) + writer.count
        assert writer.slowest < 0.1 + 2 + 1  # compact's default bounds, and room
        assert metrics.registry.get_sample_value(
            "outbox_table_bytes", {"part": "heap"}) >= before.heap_bytes  # read before it
        scan()
        scan()
        assert compactions("compacted") == 1  # once per hold
        assert metrics.registry.get_sample_value(
            "outbox_table_bytes", {"part": "heap"}) < before.heap_bytes / 20
    finally:
        resolver.close()


def test_compaction_gets_the_table_from_a_busy_relay(
        own_db_env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay under a steady load always has a batch in flight and the next one claimed
    ahead, so the table is never free; its claim ahead gives up waiting behind the
    compaction's lock request (relay/store.py, AHEAD_LOCK_WAIT) instead of keeping the relay
    from finishing the batch that holds the table. Before, at 2,000 events/s every attempt
    timed out (the --snapshot benchmark at fb9db43)."""
    monkeypatch.setattr(compact, "RETRY_PAUSE", 0.05)
    env = own_db_env
    relay = env.spawn("relay")
    writers = [Writer(env) for _ in range(4)]
    try:
        wait_until(lambda: " started" in log_of(relay), 30, "the relay to start")
        for writer in writers:
            writer.start()
        time.sleep(2)
        conn, tables = connect_pinned(env.db_url, env.table, timeout=10, application_name="t")
        with conn:
            done = compact.compact(conn, tables, lock_timeout=0.1, max_block=2, attempts=5)
        assert done.attempts <= 5
        time.sleep(0.5)
    finally:
        for writer in writers:
            writer.stop.set()
            writer.join()
        wait_until(lambda: outbox_count(env) == 0, 60, "the outbox to empty")
        assert stop(relay) == 0, log_of(relay)
    assert sum(writer.count for writer in writers) > 1000
    assert max(writer.slowest for writer in writers) < 0.1 + 2 + 1


def test_a_claim_ahead_gives_up_behind_a_request_for_the_whole_table(env: Env) -> None:
    """The store's side of the above: while a batch's claim holds the table and a VACUUM FULL
    (here LOCK TABLE) waits for it, a claim made ahead returns nothing within AHEAD_LOCK_WAIT,
    its transaction and the claim lock released, and counts it; a plain claim would queue."""
    fill(env, 20, 20)
    outbox = Tables(env.table).outbox
    batch = OutboxStore(env.db_url, env.table)
    ahead = OutboxStore(env.db_url, env.table)
    batch.connect(lock_class=1, instance=0xA1)
    ahead.connect(lock_class=1, instance=0xA2)
    request_done = threading.Event()

    def request_whole_table() -> None:
        with psycopg.connect(env.db_url) as conn:
            conn.execute("SET lock_timeout = '10s'")
            conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(outbox))
            request_done.set()

    requester = threading.Thread(target=request_whole_table)
    try:
        assert len(batch.claim(5, 1 << 20)) == 5  # the batch in flight: it holds the table
        requester.start()
        with env.connect() as conn:
            wait_until(lambda: conn.execute(
                "SELECT count(*) FROM pg_locks WHERE relation = %s::regclass AND NOT granted",
                (outbox.as_string(conn),)).fetchone()[0] == 1, 10, "the request to wait")
        started = time.monotonic()
        assert ahead.claim(5, 1 << 20, one_row_at_least=False) == []
        assert time.monotonic() - started < 2
        assert ahead.ahead_gave_up == 1 and not request_done.is_set()
        assert ahead.claim_conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        batch.rollback()  # the batch ends: the request gets the table, then lets it go
        requester.join(10)
        assert request_done.is_set()
        assert len(ahead.claim(5, 1 << 20, one_row_at_least=False)) == 5  # the claim lock is free
        ahead.rollback()
    finally:
        requester.join(15)
        batch.close()
        ahead.close()
