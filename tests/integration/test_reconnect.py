"""Servers going away mid-stream: the relay reconnects with backoff and loses nothing.

These tests restart servers, so they run on servers of their own (never on the shared ones
or on servers named by OUTBOX_TEST_* variables).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pika
import pytest

from devenv import checker
from devenv.servers import PostgresServer, RabbitServer, free_port
from tests.acceptance.test_metrics import scrape
from tests.conftest import ROOT, Env, finish_env, make_env
from tests.integration.test_pipeline import (
    in_doubt,
    log_of,
    outbox_count,
    relay_transactions,
    stop,
    wait_until,
)


@pytest.fixture(scope="module")
def own_pg() -> Iterator[PostgresServer]:
    with PostgresServer(max_prepared_transactions=16) as server:
        yield server


@pytest.fixture(scope="module")
def own_rabbit() -> Iterator[RabbitServer]:
    with RabbitServer() as server:
        yield server


@pytest.fixture
def own_env(own_pg: PostgresServer, own_rabbit: RabbitServer) -> Iterator[Env]:
    e = make_env(own_pg.url, own_rabbit.url, tag="r")
    yield e
    finish_env(e, drop=False)  # the servers go away with the module


def resolve_once(env: Env) -> None:
    result = subprocess.run([sys.executable, "-m", "outbox_relay.resolver", "--once"], env=env.cli_env(),
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_rabbitmq_restart_mid_stream(own_env: Env, own_rabbit: RabbitServer, how: str) -> None:
    env = own_env
    # The ledger stream exists before the relay starts: RabbitMQ 3.10 loses a stream for good
    # if its node is SIGKILLed within about a second of the stream's first declaration.
    conn = pika.BlockingConnection(pika.URLParameters(env.amqp_url))
    conn.channel().queue_declare(env.ledger_stream, durable=True,
                                 arguments={"x-queue-type": "stream", "x-max-age": "7D"})
    conn.close()
    time.sleep(1.5)
    with env.connect() as db:
        produced = checker.insert_events(db, env.table, 4000, exchange=env.exchange,
                                         routing_key=env.routing_key)
    relay = env.spawn("relay", OUTBOX_BATCH_SIZE="50", OUTBOX_POLL_MIN_INTERVAL="0.02",
                      OUTBOX_CONFIRM_TIMEOUT="5", OUTBOX_RECONNECT_MAX_DELAY="2")
    wait_until(lambda: outbox_count(env) < 3500, 60, "the relay to make progress")
    own_rabbit.kill() if how == "kill" else own_rabbit.stop()
    # The batch claimed ahead is let go while the relay waits for the broker: no session of
    # the relay keeps a transaction open through an outage (it would hold back VACUUM).
    wait_until(lambda: relay_transactions(env) == 0, 10, "the relay to end its transactions")
    time.sleep(2)
    assert relay_transactions(env) == 0
    assert relay.poll() is None, log_of(relay)  # a transient fault never ends the relay
    own_rabbit.restart()
    wait_until(lambda: outbox_count(env) == 0, 120, "the outbox to empty after the restart")
    assert stop(relay) == 0, log_of(relay)
    resolve_once(env)  # nothing should be left for it, but a batch may be in doubt
    report = env.drain_and_check(produced)
    # Only the batch in flight when the broker died may be delivered twice.
    assert report.ok(max_duplicates=50), report.summary()
    log = log_of(relay)
    assert log.count("rabbitmq connection lost") == 1, log  # logged once per state change
    assert log.count("rabbitmq reconnected") == 1, log


def test_postgres_crash_mid_stream(own_env: Env, own_pg: PostgresServer) -> None:
    env = own_env
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 4000, exchange=env.exchange,
                                         routing_key=env.routing_key)
    relay = env.spawn("relay", OUTBOX_BATCH_SIZE="50", OUTBOX_POLL_MIN_INTERVAL="0.02",
                      OUTBOX_RECONNECT_MAX_DELAY="2")
    resolver_port = free_port()
    resolver = env.spawn("resolver", OUTBOX_RESOLVER_INTERVAL="0.2", OUTBOX_RECONNECT_MAX_DELAY="2",
                         OUTBOX_METRICS_HOST="127.0.0.1", OUTBOX_METRICS_PORT=str(resolver_port))
    wait_until(lambda: outbox_count(env) < 3500, 60, "the relay to make progress")
    # Under load the resolver may start after the relay has made progress: its first
    # connection must come before the crash, or it has nothing to "reconnect".
    wait_until(lambda: "postgresql connected" in log_of(resolver), 30, "the resolver to connect")
    own_pg.kill()  # immediate crash: prepared transactions must survive it
    time.sleep(1)
    assert relay.poll() is None, log_of(relay)
    own_pg.restart()
    wait_until(lambda: outbox_count(env) == 0, 120, "the outbox to empty after the restart")
    # The relay finishes its own decided batch after reconnecting; the resolver any other.
    wait_until(lambda: not in_doubt(env) or relay.poll() is not None, 10, "the relay to finish")
    relay.send_signal(signal.SIGTERM)
    assert relay.wait(30) == 0, log_of(relay)
    resolve_once(env)
    report = env.drain_and_check(produced)
    assert report.ok(max_duplicates=50), report.summary()
    log = log_of(relay)
    assert log.count("postgresql connection lost") == 1, log
    assert log.count("postgresql reconnected") == 1, log
    # The resolver reconnects too, says so, and counts it.
    wait_until(lambda: "postgresql reconnected" in log_of(resolver), 30, "the resolver to reconnect")
    assert re.search(r'^outbox_resolver_reconnects_total\{server="postgresql"\} [1-9]',
                     scrape(resolver_port), re.M), scrape(resolver_port)
    assert stop(resolver) == 0, log_of(resolver)


def test_prepared_batches_survive_a_postgres_crash(own_env: Env, own_pg: PostgresServer) -> None:
    """Two batches in doubt (one with its ledger record, one without) when PostgreSQL crashes:
    both are still prepared after the restart, a live relay reconnects, the resolver commits
    one and rolls back the other, and every event arrives exactly once."""
    env = own_env
    with env.connect() as conn:
        # A key per event: the second relay's batch is not held back behind the first's.
        produced = checker.insert_events(conn, env.table, 400, exchange=env.exchange,
                                         routing_key=env.routing_key, keys=400)
    for crash_at in ("after_prepare", "after_ledger"):
        doomed = env.spawn("relay", OUTBOX_BATCH_SIZE="40", OUTBOX_TEST_CRASH_AT=crash_at)
        assert doomed.wait(30) == -signal.SIGKILL, log_of(doomed)
    prepared = sorted(in_doubt(env))
    assert len(prepared) == 2
    relay = env.spawn("relay", OUTBOX_BATCH_SIZE="40", OUTBOX_RECONNECT_MAX_DELAY="1")
    wait_until(lambda: outbox_count(env) == 80, 60, "the live relay to drain all but the doubt")
    own_pg.kill()
    time.sleep(1)
    own_pg.restart()
    assert sorted(in_doubt(env)) == prepared  # PREPARE made them durable
    wait_until(lambda: "postgresql reconnected" in log_of(relay), 30, "the relay to reconnect")
    resolve_once(env)
    # Both are finished (the live relay may already hold a batch of its own in flight).
    assert not set(in_doubt(env)) & set(prepared)
    wait_until(lambda: outbox_count(env) == 0, 60, "the rolled-back batch to be relayed")
    assert stop(relay) == 0, log_of(relay)
    report = env.drain_and_check(produced)
    assert report.ok(max_duplicates=0), report.summary()
