"""A 3-node RabbitMQ cluster (quorum sink queue, replicated ledger stream) losing nodes while
events flow: the relays move to another node and nothing is lost.

The cluster is this module's own (nodes are killed); PostgreSQL is the shared test server.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pika
import pytest

from devenv import checker
from devenv.servers import PostgresServer, RabbitCluster, RabbitServer
from tests.conftest import ROOT, Env, External, finish_env, make_env, server_url
from tests.integration.test_pipeline import in_doubt, log_of, outbox_count, stop, wait_until

BATCH = 50
RELAYS = 2
QUORUM = {"x-queue-type": "quorum"}
FAST = {"OUTBOX_BATCH_SIZE": str(BATCH), "OUTBOX_POLL_MIN_INTERVAL": "0.02",
        "OUTBOX_CONFIRM_TIMEOUT": "5", "OUTBOX_RECONNECT_MAX_DELAY": "1",
        "OUTBOX_CONNECT_TIMEOUT": "3"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[RabbitCluster]:
    with RabbitCluster(3) as servers:
        yield servers


@contextmanager
def cluster_env(pg_server: PostgresServer | External, cluster: RabbitCluster,
                queue_arguments: dict[str, str] | None) -> Iterator[Env]:
    """An env on the cluster whose ledger exists (replicated) before any node is killed:
    RabbitMQ 3.10 loses a stream whose node dies within about a second of its first
    declaration. Afterwards every node runs again."""
    e = make_env(server_url(pg_server), cluster.url, tag="c", queue_arguments=queue_arguments)
    try:
        conn, channel = e.amqp_channel()
        channel.queue_declare(e.ledger_stream, durable=True, arguments={
            "x-queue-type": "stream", "x-max-age": "7D", "x-initial-cluster-size": 3})
        conn.close()
        time.sleep(1.5)
        yield e
    finally:
        finish_env(e)
        heal(cluster)


@pytest.fixture
def cenv(pg_server: PostgresServer | External, cluster: RabbitCluster) -> Iterator[Env]:
    with cluster_env(pg_server, cluster, QUORUM) as e:
        yield e


def heal(cluster: RabbitCluster) -> None:
    """Every node running again (started together: a node may wait for its peers)."""
    down = [node for node in cluster.nodes if not node.running]
    threads = [threading.Thread(target=node.restart) for node in down]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def run_with_fault(env: Env, cluster: RabbitCluster, fault: str) -> None:
    with env.connect() as db:
        produced = checker.insert_events(db, env.table, 5000, exchange=env.exchange,
                                         routing_key=env.routing_key)
    relays = [env.spawn("relay", **FAST) for _ in range(RELAYS)]
    resolver = env.spawn("resolver", OUTBOX_RESOLVER_INTERVAL="0.5",
                         OUTBOX_RECONNECT_MAX_DELAY="1", OUTBOX_CONNECT_TIMEOUT="3")
    wait_until(lambda: outbox_count(env) < 4500, 90, "the relays to make progress")
    victim = pick(env, cluster, fault)
    assert victim is not None, cluster.ctl("list_queues", "name", "leader")
    if fault == "stop":
        victim.stop()
    else:
        victim.kill()
    time.sleep(3)
    left_while_down = outbox_count(env)
    wait_until(lambda: outbox_count(env) < left_while_down or outbox_count(env) == 0, 60,
               "events to flow with a node down")
    heal(cluster)
    wait_until(lambda: outbox_count(env) == 0 and not in_doubt(env), 120,
               "the outbox to drain")
    for proc in [*relays, resolver]:
        assert proc.poll() is None, log_of(proc)  # a node's death never ends a program
        assert stop(proc) == 0, log_of(proc)
    report = env.drain_and_check(produced)
    # Only the batches in flight when the node died may be delivered twice.
    assert report.ok(max_duplicates=BATCH * RELAYS), report.summary()


def pick(env: Env, cluster: RabbitCluster, fault: str) -> RabbitServer | None:
    if fault == "connected_node":
        return cluster.connected_node("outbox-relay")
    if fault == "ledger_leader":
        return cluster.leader(env.ledger_stream)
    if fault == "sink_leader":
        return cluster.leader(env.queue)
    return cluster.nodes[1]


@pytest.mark.parametrize("fault", ["connected_node", "ledger_leader", "sink_leader", "stop"])
def test_a_node_lost_while_events_flow_loses_nothing(cenv: Env, cluster: RabbitCluster,
                                                     fault: str) -> None:
    run_with_fault(cenv, cluster, fault)


def test_no_majority_commits_nothing_until_it_is_back(cenv: Env, cluster: RabbitCluster) -> None:
    """Two nodes of three down: the quorum sink and the ledger stream confirm nothing, so no
    batch may commit in PostgreSQL; the relays keep running, and once a node is back every
    event arrives."""
    env = cenv
    with env.connect() as db:
        produced = checker.insert_events(db, env.table, 3000, exchange=env.exchange,
                                         routing_key=env.routing_key)
    relays = [env.spawn("relay", **FAST) for _ in range(RELAYS)]
    wait_until(lambda: outbox_count(env) < 2800, 90, "the relays to make progress")
    survivor = cluster.nodes[0]
    for node in cluster.nodes[1:]:
        node.kill()
    assert_nothing_commits(env, relays, "a batch committed without a majority")
    assert survivor.running
    heal_and_check(env, cluster, relays, produced)


def assert_nothing_commits(env: Env, relays: list[subprocess.Popen[bytes]], what: str) -> None:
    """After a fault: the outbox stays as it is for 10 s and every relay keeps running."""
    time.sleep(8)  # batches in flight at the fault finish or fail (confirm timeout 5 s)
    before = outbox_count(env)
    time.sleep(10)
    assert outbox_count(env) == before, what
    for proc in relays:
        assert proc.poll() is None, log_of(proc)


def heal_and_check(env: Env, cluster: RabbitCluster, relays: list[subprocess.Popen[bytes]],
                   produced: list[str]) -> None:
    """Every node back: every event arrives, none dead-lettered, duplicates only from the
    batches the fault caught (a few per relay)."""
    heal(cluster)
    wait_until(lambda: outbox_count(env) == 0 and not in_doubt(env), 120, "the outbox to drain")
    for proc in relays:
        assert stop(proc) == 0, log_of(proc)
    report = env.drain_and_check(produced)
    assert report.ok(max_duplicates=BATCH * RELAYS * 4), report.summary()
    assert all("dead-lettered" not in log_of(proc) for proc in relays)


def test_the_ledger_is_replicated_and_a_single_replica_one_is_refused(
    pg_server: PostgresServer | External, cluster: RabbitCluster,
) -> None:
    env = make_env(server_url(pg_server), cluster.url, tag="c", queue_arguments=QUORUM)
    try:
        with env.connect() as db:
            produced = checker.insert_events(db, env.table, 100, exchange=env.exchange,
                                             routing_key=env.routing_key)
        relay = env.spawn("relay", **FAST)
        wait_until(lambda: outbox_count(env) == 0, 60, "the relay to drain the outbox")
        assert stop(relay) == 0, log_of(relay)
        assert cluster.queue_info(env.ledger_stream)["members"].count("@") == 3
        assert env.drain_and_check(produced).ok(), "events lost"

        single = env.ledger_stream + ".single"
        conn = pika.BlockingConnection(pika.URLParameters(cluster.urls[0]))
        conn.channel().queue_declare(single, durable=True, arguments={
            "x-queue-type": "stream", "x-max-age": "7D", "x-initial-cluster-size": 1})
        conn.close()
        result = subprocess.run([sys.executable, "-m", "outbox_relay.relay"], cwd=ROOT, timeout=60,
                                env=env.cli_env(OUTBOX_LEDGER_STREAM=single, **FAST),
                                capture_output=True, text=True)
        assert result.returncode == 3, result.stderr
        errors = [line for line in result.stderr.splitlines() if "single replica" in line]
        assert len(errors) == 1 and "x-initial-cluster-size 1" in errors[0], result.stderr
        assert "guest:guest" not in result.stderr
    finally:
        finish_env(env)



def test_a_classic_sink_queue_returns_its_events_while_its_node_is_down(
    pg_server: PostgresServer | External, cluster: RabbitCluster,
) -> None:
    """A classic queue lives on one node. While that node is down, RabbitMQ 3.10 returns what
    is routed to it as unroutable (312 NO_ROUTE), so no batch commits and each row's attempt is
    counted and retried with backoff; once the node is back every event arrives, if that came
    before the rows ran out of attempts (docs/reliability.md, "What a confirm guarantees")."""
    with cluster_env(pg_server, cluster, None) as env:  # a classic queue
        home = cluster.home(env.queue)
        assert home is not None, cluster.ctl("list_queues", "name", "pid")
        with env.connect() as db:
            produced = checker.insert_events(db, env.table, 3000, exchange=env.exchange,
                                             routing_key=env.routing_key)
        # Attempts that do not run out during the outage, retries at most 2 s apart.
        patient = {**FAST, "OUTBOX_RETRY_BASE_DELAY": "0.5", "OUTBOX_RETRY_MAX_DELAY": "2",
                   "OUTBOX_MAX_ATTEMPTS": "1000"}
        relays = [env.spawn("relay", **patient) for _ in range(RELAYS)]
        wait_until(lambda: outbox_count(env) < 2800, 90, "the relays to make progress")
        home.kill()
        assert_nothing_commits(env, relays, "a batch committed while its queue's node was down")
        assert any("312 NO_ROUTE" in log_of(proc) for proc in relays)
        heal_and_check(env, cluster, relays, produced)
