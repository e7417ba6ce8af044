"""PostgreSQL failover: a primary with a streaming standby, promoted while relays hold
prepared batches (as Patroni or a cloud database fails over). The programs reach both through
libpq's multi-host URL with target_session_attrs=read-write.

Every test has a pair of its own: the primary is killed and the standby promoted.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from devenv import checker
from devenv.servers import PostgresPair, RabbitServer
from outbox_relay.tables import Tables
from tests.conftest import ROOT, Env, External, finish_env, make_env, server_url
from tests.integration.test_pipeline import in_doubt, log_of, outbox_count, stop, wait_until

FAST = {"OUTBOX_BATCH_SIZE": "40", "OUTBOX_POLL_MIN_INTERVAL": "0.02",
        "OUTBOX_RECONNECT_MAX_DELAY": "1", "OUTBOX_CONNECT_TIMEOUT": "3"}


@pytest.fixture
def sync_pair() -> Iterator[PostgresPair]:
    with PostgresPair(sync=True, max_prepared_transactions=16) as pair:
        yield pair


@pytest.fixture
def async_pair() -> Iterator[PostgresPair]:
    with PostgresPair(sync=False, max_prepared_transactions=16) as pair:
        yield pair


def pair_env(pair: PostgresPair, rabbit: RabbitServer | External) -> Env:
    return make_env(pair.url, server_url(rabbit), tag="f")


def resolve_once(env: Env) -> None:
    result = subprocess.run([sys.executable, "-m", "outbox_relay.resolver", "--once"], env=env.cli_env(),
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_promotion_with_batches_in_doubt_loses_nothing(
    sync_pair: PostgresPair, rabbit_server: RabbitServer | External,
) -> None:
    """Two batches in doubt (one with its ledger record, one without) when the primary dies:
    both were replicated, the promoted standby has them prepared, the resolver finishes them
    from the ledger (their relays' locks died with the old primary), a live relay moves to the
    new primary and drains the rest."""
    env = pair_env(sync_pair, rabbit_server)
    try:
        with env.connect() as conn:
            # A key per event: the second relay's batch is not held back behind the first's.
            produced = checker.insert_events(conn, env.table, 2000, exchange=env.exchange,
                                             routing_key=env.routing_key, keys=2000)
        for crash_at in ("after_prepare", "after_ledger"):
            doomed = env.spawn("relay", OUTBOX_TEST_CRASH_AT=crash_at, **FAST)
            assert doomed.wait(30) == -signal.SIGKILL, log_of(doomed)
        prepared = sorted(in_doubt(env))
        assert len(prepared) == 2
        relay = env.spawn("relay", **FAST)
        wait_until(lambda: outbox_count(env) < 1500, 60, "the live relay to make progress")
        sync_pair.failover()
        assert sorted(set(in_doubt(env)) & set(prepared)) == prepared  # replayed, still prepared
        resolver = env.spawn("resolver", OUTBOX_RESOLVER_INTERVAL="0.5",
                             OUTBOX_RECONNECT_MAX_DELAY="1")
        wait_until(lambda: outbox_count(env) == 0 and not in_doubt(env), 90,
                   "the new primary's outbox to drain and the doubt to end")
        assert relay.poll() is None, log_of(relay)
        assert "postgresql reconnected" in log_of(relay)
        assert stop(relay) == 0 and stop(resolver) == 0
        report = env.drain_and_check(produced)
        # The batch of the live relay in flight at the failover may come twice.
        assert report.ok(max_duplicates=40), report.summary()
    finally:
        finish_env(env, drop=False)


def test_commit_prepared_acknowledged_on_a_sync_primary_stays_committed(
    sync_pair: PostgresPair,
) -> None:
    with psycopg.connect(sync_pair.url, autocommit=True) as conn:
        conn.execute("CREATE TABLE facts (n int)")
        conn.execute("BEGIN")
        conn.execute("INSERT INTO facts VALUES (1)")
        conn.execute("PREPARE TRANSACTION 'f:1'")
        conn.execute("COMMIT PREPARED 'f:1'")  # waits for the synchronous standby's flush
    sync_pair.failover()  # at once: no time for anything else to replicate
    with psycopg.connect(sync_pair.url, autocommit=True) as conn:
        assert conn.info.port == sync_pair.standby.port
        assert conn.execute("SELECT n FROM facts").fetchall() == [(1,)]
        assert conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone() == (0,)


def produce_facts(conn: psycopg.Connection[Any], env: Env, lo: int, hi: int) -> list[str]:
    """Events whose business row (facts) commits in the same transaction, as a service does."""
    outbox = Tables(env.table).outbox
    with conn.transaction():
        conn.execute("INSERT INTO facts SELECT 'g-' || n FROM generate_series(%s::int, %s) n",
                     (lo, hi))
        conn.execute(sql.SQL(
            "INSERT INTO {} (message_id, exchange, routing_key, payload) SELECT 'g-' || n, %s, "
            "%s, jsonb_build_object('seq', n) FROM generate_series(%s::int, %s) n").format(outbox),
            (env.exchange, env.routing_key, lo, hi))
    return [f"g-{n}" for n in range(lo, hi + 1)]


def ghosts_after_async_failover(pair: PostgresPair, rabbit: RabbitServer | External,
                                **relay_env: str) -> int:
    """Events delivered whose business row the promoted standby does not have.

    The standby stops receiving (as an asynchronous one lagging behind), producers commit 200
    events on the primary, the relay gets 3 s to publish them, then the primary dies and the
    standby is promoted."""
    env = pair_env(pair, rabbit)
    try:
        with env.connect() as conn:
            conn.execute("CREATE TABLE facts (message_id text PRIMARY KEY)")
            produce_facts(conn, env, 0, 99)
        relay = env.spawn("relay", **FAST, **relay_env)
        wait_until(lambda: outbox_count(env) == 0, 60, "the first events to go out")
        pair.standby.stop("fast")
        with env.connect() as conn:
            produce_facts(conn, env, 100, 299)
        time.sleep(3)
        relay.kill()
        pair.primary.kill()
        pair.standby.start()
        pair.standby.promote()
        delivered = {d.message_id for d in checker.drain(env.amqp_url, env.queue)}
        with env.connect() as conn:
            facts = {r[0] for r in conn.execute("SELECT message_id FROM facts")}
        return len(delivered - facts)
    finally:
        finish_env(env, drop=False)


def test_async_failover_publishes_ghosts_without_the_standby_wait(
    async_pair: PostgresPair, rabbit_server: RabbitServer | External,
) -> None:
    assert ghosts_after_async_failover(async_pair, rabbit_server) == 200


def test_the_standby_wait_publishes_no_ghost(
    async_pair: PostgresPair, rabbit_server: RabbitServer | External,
) -> None:
    assert ghosts_after_async_failover(async_pair, rabbit_server, OUTBOX_STANDBY_WAIT="standby",
                                       OUTBOX_STANDBY_WAIT_TIMEOUT="1") == 0
