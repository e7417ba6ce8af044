"""The cluster chaos run: ``./dev chaos --cluster`` (or ``python -m devenv.chaos_cluster``).

A 3-node RabbitMQ cluster (a quorum sink queue, the ledger stream replicated on all three
nodes) and a PostgreSQL primary with a synchronous streaming standby; 4 relays and a resolver
given every node's URL (OUTBOX_AMQP_URL) and libpq's multi-host URL with
target_session_attrs=read-write (OUTBOX_DATABASE_URL). While a producer inserts a steady stream
of events and the hostile producer (devenv/chaos_run.py, as in devenv/chaos.py) mixes in rows
that must be dead-lettered, a loop injects, every few seconds, one of:

- ``relay``: SIGKILL of a relay (restarted at once);
- ``connected_node``: SIGKILL of the RabbitMQ node a relay is connected to (restarted later);
- ``ledger_leader`` / ``sink_leader``: SIGKILL of the ledger stream's / sink queue's leader;
- ``node_restart``: a node stopped gracefully and started again;
- ``no_majority``: two nodes of three down for a while (nothing may commit meanwhile);
- ``promote``: the PostgreSQL primary SIGKILLed and its standby promoted while relays hold
  prepared batches (a new standby is then built on the old primary's port);
- ``postgres``: an immediate-mode crash and restart of the primary;
- ``cut``: every connection through the proxies of the RabbitMQ nodes, of the PostgreSQL
  hosts, or of both, closed at once (the relays and the resolver reach every server through
  a loopback proxy of its own, devenv/proxy.py);
- ``blackhole``: one RabbitMQ node's proxy, or the PostgreSQL primary's, stops forwarding for
  1-6 s (a partition: nothing answers), then drops the connections it held.

A consumer reads the sink all along (moving to another node when its own dies;
``--single-active-consumer`` declares the sink with it). A second quorum queue, the audit
queue, gets a copy of every event and is read only after the run, on a calm cluster: its
order is the order the events reached the broker, which is what the relays guarantee per key;
the consumer's own order is reported beside it (a 3.10 quorum queue can hand a consumer
messages out of order by itself, ``order_violation_details``). The time from
each fault until events flow again is measured on the relays' commits (sampled every 0.1 s):
the end of the longest pause over 1 s that began within 5 s of the fault (else the first
commit after it). At the end everything drains and the total-queue checker runs: lost, unexpected,
duplicates, order at the broker, dead letters, what is left in the outbox or in doubt.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import psycopg

from devenv import checker
from devenv.chaos_run import (
    EXCHANGE,
    LEDGER,
    MAX_MESSAGE_BYTES,
    QUEUE,
    HostileProducer,
    Producer,
    Tally,
    scalar,
    spawn,
    watch_in_doubt,
)
from devenv.proxy import LOOPBACK, Proxy
from devenv.servers import PostgresPair, RabbitCluster, RabbitServer
from outbox_relay.schema import migrate

AUDIT = "chaos.audit"  # a copy of every event, read after the run: the broker's order

# Faults and their weights: node kills the most, the slow ones (promotion, no majority) less.
FAULTS = {"relay": 3, "connected_node": 2, "ledger_leader": 2, "sink_leader": 2,
          "node_restart": 1, "no_majority": 1, "promote": 1, "postgres": 1, "cut": 2,
          "blackhole": 1}


@dataclass
class Figures:
    faults: dict[str, int] = field(default_factory=dict)
    injected: list[tuple[str, float]] = field(default_factory=list)  # (kind, monotonic time)
    # Samples in which the relays' committed count grew while two nodes of three were down.
    committed_without_majority: int = 0


@dataclass(frozen=True)
class Received:
    """One delivery to the consumer, with what explains its place in the order."""

    delivery: checker.Delivery
    redelivered: bool  # the broker's flag
    connection: int  # which of the consumer's connections (1, 2, ...) got it
    delivery_count: int | None  # the quorum queue's x-delivery-count (absent on a first one)
    at: float  # time.monotonic() when it came


class Consumer(threading.Thread):
    """Reads the sink queue all along, acking each delivery; reconnects to any live node."""

    def __init__(self, cluster: RabbitCluster, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.cluster, self.stop_event = cluster, stop
        self.received: list[Received] = []
        self.idle_since = time.monotonic()
        self.connection = 0

    @property
    def deliveries(self) -> list[checker.Delivery]:
        return [r.delivery for r in self.received]

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                params = [pika.URLParameters(u) for u in self.cluster.urls]
                for p in params:
                    p.connection_attempts, p.socket_timeout = 1, 3
                random.shuffle(params)
                conn = pika.BlockingConnection(params)
                self.connection += 1
                try:
                    channel = conn.channel()
                    channel.basic_qos(prefetch_count=2000)
                    for method, props, body in channel.consume(QUEUE, inactivity_timeout=0.5):
                        if self.stop_event.is_set():
                            break
                        if method is None:
                            continue
                        self._record(method, props, body)
                        channel.basic_ack(method.delivery_tag)
                finally:
                    if conn.is_open:
                        conn.close()
            except (pika.exceptions.AMQPError, OSError, ValueError):
                time.sleep(0.3)

    def _record(self, method: Any, props: Any, body: bytes) -> None:
        count = (props.headers or {}).get("x-delivery-count")
        self.received.append(Received(checker.delivery(props, body), bool(method.redelivered),
                                      self.connection, count if isinstance(count, int) else None,
                                      time.monotonic()))
        self.idle_since = time.monotonic()


class Flow(threading.Thread):
    """Samples, every 0.1 s, how many events the relays have committed so far (produced minus
    still in the outbox: a claimed row counts once its batch commits; hostile rows aside) and
    keeps the times at which that number grew. Independent of the consumer, which may be
    reconnecting itself."""

    def __init__(self, url: Callable[[], str], producer: Producer,
                 stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.producer, self.stop_event = url, producer, stop
        self.times: list[float] = []

    def run(self) -> None:
        last = -1.0
        conn: psycopg.Connection[Any] | None = None
        while not self.stop_event.wait(0.1):
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(self.url(), autocommit=True, connect_timeout=1)
                # Under the producer's lock: no commit of its between the count and the tally.
                with self.producer.lock:
                    row = conn.execute("SELECT count(*) FROM outbox"
                                       " WHERE starts_with(message_id, 'c-')").fetchone()
                    produced = len(self.producer.tally.produced)
            except psycopg.Error:
                conn = None
                continue
            relayed = produced - (row[0] if row else 0)
            if relayed > last:
                self.times.append(time.monotonic())
            last = max(last, relayed)


def redelivered_copies(received: list[Received]) -> int:
    """Copies of a message the consumer had received already that the broker marked
    redelivered: the consumer's own duplicates (the ack of the first copy was lost with its node
    or connection), not the relays' (a copy the relays published again is new to the broker)."""
    seen: set[str] = set()
    copies = 0
    for r in received:
        copies += r.redelivered and r.delivery.message_id in seen
        seen.add(r.delivery.message_id)
    return copies


def late_redeliveries(late: list[tuple[int, str]], received: list[Received]) -> int:
    """Of the order violations at the consumer (``late``: checker.late_first_copies), those
    whose late event came as a broker redelivery: a message handed to a consumer that died with
    it, returned after newer ones went to the next consumer (the consumer's side)."""
    return sum(received[i].redelivered for i, _key in late)


def _first_newer(deliveries: list[checker.Delivery], late: int, key: str) -> int | None:
    """The first delivery of a newer event of ``key`` before the late first copy at ``late``."""
    seq = deliveries[late].seq or 0
    return next((j for j in range(late) if deliveries[j].key == key
                 and (deliveries[j].seq or 0) > seq), None)


def reversed_run(received: list[Received], newer: int, late: int) -> bool:
    """True when the deliveries from ``newer`` to ``late`` came on one connection, none marked
    redelivered, their positions strictly falling: how a RabbitMQ 3.10 quorum queue serves the
    deliveries a channel missed (rabbit_fifo_client:get_missing_deliveries; the leader's
    get_checked_out returns them newest first, fixed in RabbitMQ 4.2.6, rabbitmq-server#16008)."""
    run = received[newer:late + 1]
    positions = [r.delivery.seq or 0 for r in run]
    return (len({r.connection for r in run}) == 1 and not any(r.redelivered for r in run)
            and all(a > b for a, b in itertools.pairwise(positions)))


def order_violation_details(received: list[Received], late: list[tuple[int, str]],
                            started: float,
                            injected: list[tuple[str, float]]) -> list[dict[str, object]]:
    """Each late first copy at the consumer (``late``: checker.late_first_copies) beside the
    newer event of its key that came before it: the connection each came on, the broker's
    redelivered flag and x-delivery-count, seconds into the run, the last fault before it, and
    whether the two ends and everything between came as one reversed run."""
    def described(i: int) -> dict[str, object]:
        r = received[i]
        faults = [(kind, round(r.at - when, 2)) for kind, when in injected if when <= r.at]
        return {"message_id": r.delivery.message_id, "seq": r.delivery.seq,
                "connection": r.connection, "redelivered": r.redelivered,
                "delivery_count": r.delivery_count, "at": round(r.at - started, 2),
                "after_fault": faults[-1] if faults else None}

    deliveries = [r.delivery for r in received]
    details: list[dict[str, object]] = []
    for i, key in late:
        newer = _first_newer(deliveries, i, key)
        details.append({"key": key, "late": described(i),
                        "first_newer": described(newer) if newer is not None else None,
                        "reversed_run": newer is not None and reversed_run(received, newer, i)})
    return details


def recovery_seconds(times: list[float], at: float, until: float) -> float:
    """From a fault injected at ``at`` until events flow again: the end of the longest pause
    (over 1 s) in the relays' commits that began within 5 s of the fault, before ``until`` (the
    next fault); without such a pause, the time to the first commit after the fault."""
    before = [t for t in times if t < at]
    inside = [t for t in times if at <= t < until]
    if not inside:
        return round(until - at, 3)
    points = before[-1:] + inside
    pauses = [b - at for a, b in itertools.pairwise(points) if b - a >= 1.0 and a <= at + 5]
    return round(max(pauses, default=inside[0] - at), 3)


@dataclass
class Injector:
    rng: random.Random
    tally: Tally
    figures: Figures
    cluster: RabbitCluster
    pair: PostgresPair
    spawn_relay: Callable[[int], Any]
    procs: list[Any]
    relay_count: int
    # Nodes being restarted in the background: a RabbitMQ node takes 10-20 s to boot here, and
    # the relay and PostgreSQL faults need not wait for it (the next RabbitMQ fault does).
    restarts: list[threading.Thread] = field(default_factory=list)
    flow: Flow | None = None  # the relays' commits, for the no-majority check
    # The relays' and the resolver's way to each server: one proxy per RabbitMQ node (in the
    # cluster's order) and one per PostgreSQL port (the pair keeps its two ports).
    mq_proxies: list[Proxy] = field(default_factory=list)
    pg_proxies: dict[int, Proxy] = field(default_factory=dict)

    def inject(self, fault: str) -> None:
        if fault not in ("relay", "promote", "postgres", "cut", "blackhole"):
            self.wait_restarts()
        self.figures.injected.append((fault, time.monotonic()))
        getattr(self, f"_{fault}")()
        self.figures.faults[fault] = self.figures.faults.get(fault, 0) + 1

    def wait_restarts(self) -> None:
        for thread in self.restarts:
            thread.join()
        self.restarts.clear()

    def _restart_later(self, nodes: list[RabbitServer], low: float, high: float) -> None:
        delay = self.rng.uniform(low, high)

        def restart(node: RabbitServer) -> None:
            time.sleep(delay)
            node.restart()

        for node in nodes:
            thread = threading.Thread(target=restart, args=(node,), daemon=True)
            thread.start()
            self.restarts.append(thread)

    def _kill_node(self, node: RabbitServer | None) -> None:
        if node is None or not node.running:
            node = self.rng.choice(self.cluster.running())
        node.kill()
        self.tally.rabbitmq_restarts += 1
        self._restart_later([node], 1, 4)

    def _relay(self) -> None:
        i = self.rng.randrange(self.relay_count)
        self.procs[i].kill()
        self.procs[i].wait()
        self.procs[i] = self.spawn_relay(i)
        self.tally.relay_kills += 1

    def _connected_node(self) -> None:
        self._kill_node(self.cluster.connected_node("outbox-relay"))

    def _ledger_leader(self) -> None:
        self._kill_node(self.cluster.leader(LEDGER))

    def _sink_leader(self) -> None:
        self._kill_node(self.cluster.leader(QUEUE))

    def _node_restart(self) -> None:
        node = self.rng.choice(self.cluster.running())
        node.stop()
        self.tally.rabbitmq_restarts += 1
        self._restart_later([node], 1, 3)

    def _no_majority(self) -> None:
        """Two nodes of three down: the quorum sink and the replicated ledger confirm nothing,
        so nothing may commit (nor may confirmed rows of a failed batch be forgotten): any
        growth of the relays' committed count (Flow) in the window is counted."""
        down = self.rng.sample(self.cluster.nodes, 2)
        for node in down:
            node.kill()
        self.tally.rabbitmq_restarts += 2
        time.sleep(7)  # the batches in flight end (confirm timeout 5 s)
        since = time.monotonic()
        time.sleep(self.rng.uniform(4, 8))
        if self.flow is not None:
            self.figures.committed_without_majority += sum(
                1 for t in self.flow.times if since <= t <= time.monotonic())
        self._restart_later(down, 0, 0.5)

    def _promote(self) -> None:
        """The primary dies with batches in doubt; its synchronous standby is promoted; a new
        standby is built on the old primary's port so the URL stays the same."""
        self.pair.failover()
        self.pair.rebuild()
        self.tally.postgres_restarts += 1

    def _postgres(self) -> None:
        self.pair.primary.stop("immediate")
        time.sleep(self.rng.uniform(0.5, 2))
        self.pair.primary.restart()
        self.tally.postgres_restarts += 1

    def _cut(self) -> None:
        pg = list(self.pg_proxies.values())
        for proxy in self.rng.choice([self.mq_proxies, pg, self.mq_proxies + pg]):
            proxy.cut()
        self.tally.connection_cuts += 1

    def _blackhole(self) -> None:
        """A partition of one server: a RabbitMQ node (its peers and the other relays carry
        on) or the PostgreSQL primary (every relay waits)."""
        proxy = self.rng.choice([*self.mq_proxies, self.pg_proxies[self.pair.primary.port]])
        proxy.blackhole()
        time.sleep(self.rng.uniform(1, 6))
        proxy.heal()
        self.tally.black_holes += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev chaos --cluster", description=__doc__)
    parser.add_argument("--duration", type=float, default=60, help="seconds of chaos")
    parser.add_argument("--rate", type=float, default=300, help="events per second offered")
    parser.add_argument("--relays", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--fault-gap", type=float, nargs=2, default=(5.0, 12.0),
                        metavar=("MIN", "MAX"), help="seconds between faults (default: 5 12)")
    parser.add_argument("--cycle", action="store_true",
                        help="inject every kind of fault in turn instead of at random by weight")
    parser.add_argument("--kinds", type=lambda text: text.split(","), default=None,
                        metavar="KIND,KIND", help="inject only these kinds of fault "
                        f"(default: all of {', '.join(FAULTS)})")
    parser.add_argument("--single-active-consumer", action="store_true",
                        help="declare the sink with single active consumer (default: a plain "
                        "queue, the consumer reconnecting to any node)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--hostile-gap", type=float, default=2.0, metavar="SECONDS",
                        help="mean seconds between hostile rows (0: none; default: 2)")
    args = parser.parse_args(argv)
    kinds = args.kinds or list(FAULTS)
    if not set(kinds) <= set(FAULTS):
        parser.error(f"--kinds: unknown kind(s) {', '.join(sorted(set(kinds) - set(FAULTS)))}")
    rng = random.Random(args.seed)
    tally, figures = Tally(), Figures()

    with ExitStack() as stack:
        started_servers = time.monotonic()
        pair = PostgresPair(sync=True, max_prepared_transactions=32)
        stack.callback(pair.cleanup)
        cluster = RabbitCluster(3)
        stack.callback(cluster.cleanup)
        boot = threading.Thread(target=pair.start)
        boot.start()
        cluster.start()
        boot.join()
        pair.wait_streaming()
        logdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="outbox-chaos-")))

        migrate(pair.url, "outbox")
        conn = pika.BlockingConnection(pika.URLParameters(cluster.urls[0]))
        channel = conn.channel()
        channel.exchange_declare(EXCHANGE, exchange_type="topic", durable=True)
        # A plain consumer that reconnects can break per-key order itself (docs/reliability.md:
        # messages it held come back after newer ones); --single-active-consumer is the README's
        # advice, but short runs with it still counted violations (not explained yet).
        channel.queue_declare(QUEUE, durable=True, arguments={
            "x-queue-type": "quorum", "x-single-active-consumer": args.single_active_consumer})
        channel.queue_bind(QUEUE, EXCHANGE, routing_key="#")
        # Nobody consumes the audit queue during the run, so no fault can touch its deliveries:
        # read on a calm cluster at the end, it has the events in the order they reached the
        # broker (a relay's confirm waits for both queues).
        channel.queue_declare(AUDIT, durable=True, arguments={"x-queue-type": "quorum"})
        channel.queue_bind(AUDIT, EXCHANGE, routing_key="#")
        channel.queue_declare(LEDGER, durable=True, arguments={
            "x-queue-type": "stream", "x-max-age": "7D", "x-initial-cluster-size": 3})
        conn.close()
        time.sleep(1.5)  # RabbitMQ 3.10 loses a stream killed within ~1 s of its declaration
        print(f"servers up in {time.monotonic() - started_servers:.0f} s", flush=True)

        mq_proxies = [stack.enter_context(Proxy.to(url)) for url in cluster.urls]
        pg_proxies = {server.port: stack.enter_context(Proxy(LOOPBACK, server.port))
                      for server in (pair.primary, pair.standby)}
        hosts = ",".join(f"{LOOPBACK}:{proxy.port}" for proxy in pg_proxies.values())
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env.update({"OUTBOX_DATABASE_URL": pair.url_via(hosts),
                    "OUTBOX_AMQP_URL": ",".join(proxy.url(url) for proxy, url
                                                in zip(mq_proxies, cluster.urls, strict=True)),
                    "OUTBOX_BATCH_SIZE": str(args.batch_size), "OUTBOX_METRICS_PORT": "0",
                    "OUTBOX_CONFIRM_TIMEOUT": "5", "OUTBOX_RECONNECT_MAX_DELAY": "2",
                    "OUTBOX_CONNECT_TIMEOUT": "3",
                    "OUTBOX_MAX_MESSAGE_BYTES": str(MAX_MESSAGE_BYTES),
                    "OUTBOX_RESOLVER_INTERVAL": "1", "PYTHONPATH": str(Path.cwd())})
        names = [*(f"relay-{i}" for i in range(args.relays)), "resolver"]
        procs = [spawn(name, name.split("-")[0], env, logdir) for name in names]

        injector = Injector(rng, tally, figures, cluster, pair,
                            lambda i: spawn(f"relay-{i}", "relay", env, logdir), procs,
                            args.relays, mq_proxies=mq_proxies, pg_proxies=pg_proxies)

        def respawn_exited() -> None:
            for i, proc in enumerate(procs):
                if proc.poll() is not None:
                    tally.unexpected_exits += 1
                    print(f"  {names[i]} exited by itself ({proc.returncode}); restarted",
                          flush=True)
                    procs[i] = spawn(names[i], names[i].split("-")[0], env, logdir)

        def kill_all() -> None:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

        stack.callback(kill_all)
        stop, watching, consuming = threading.Event(), threading.Event(), threading.Event()
        watching.set()
        producer = Producer(pair.url, args.rate, stop, tally)
        producer.start()
        hostile = HostileProducer(pair.url, cluster.urls[0], args.hostile_gap, stop, tally,
                                  random.Random(rng.random()))
        hostile.amqp_url = cluster.url.split(",")[0]
        if args.hostile_gap > 0:
            hostile.start()
        consumer = Consumer(cluster, consuming)
        consumer.start()
        flow = Flow(lambda: pair.url, producer, consuming)
        flow.start()
        injector.flow = flow
        watch = threading.Thread(target=watch_in_doubt, args=(pair.url, watching, tally),
                                 daemon=True)
        watch.start()

        print(f"cluster chaos for {args.duration:.0f} s: {args.relays} relays, "
              f"{args.rate:.0f} events/s, logs in {logdir}", flush=True)
        started = time.monotonic()
        next_fault = started + rng.uniform(*args.fault_gap)
        # In turn: the slow checks first, and RabbitMQ faults (which wait for the last node's
        # restart) between the others, so a short run covers the most kinds.
        cycle = [kind for kind in ("no_majority", "relay", "promote", "cut", "connected_node",
                                   "blackhole", "postgres", "ledger_leader", "sink_leader",
                                   "node_restart") if kind in kinds]
        count = 0
        while time.monotonic() - started < args.duration:
            respawn_exited()
            if time.monotonic() >= next_fault:
                if args.cycle:
                    fault = cycle[count % len(cycle)]
                else:
                    fault = rng.choices(kinds, weights=[FAULTS[k] for k in kinds])[0]
                count += 1
                injector.inject(fault)
                print(f"  {time.monotonic() - started:6.1f} s  fault: {fault}", flush=True)
                next_fault = time.monotonic() + rng.uniform(*args.fault_gap)
            time.sleep(0.5)

        stop.set()
        producer.join(30)
        if hostile.is_alive():
            hostile.join(30)
        injector.wait_restarts()  # every node back for the drain
        for node in cluster.nodes:
            if not node.running:
                node.restart()
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            left = scalar(pair.url, "SELECT count(*) FROM outbox")
            doubt = scalar(pair.url, "SELECT count(*) FROM pg_prepared_xacts")
            if left == 0 and doubt == 0:
                break
            respawn_exited()
            time.sleep(1)
        watching.clear()
        watch.join(10)
        for proc in procs:
            proc.terminate()
            proc.wait(60)
        expected = set(tally.produced)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not expected <= {
                d.message_id for d in consumer.deliveries}:
            time.sleep(1)
        while time.monotonic() - consumer.idle_since < 3:
            time.sleep(0.5)
        consuming.set()
        consumer.join(10)
        with psycopg.connect(pair.url, autocommit=True) as db:
            report = checker.check(tally.produced, consumer.deliveries, conn=db, table="outbox")
        audit = checker.drain(cluster.url, AUDIT, expected=expected, total_timeout=300)
        audit_missing = len(expected - {d.message_id for d in audit})
        # Per-key order is judged where the relays' guarantee holds: at the broker.
        report = dataclasses.replace(report, order_violations=dict(
            Counter(key for _i, key in checker.late_first_copies(audit))))
        expected_dead = set(tally.hostile)
        missing_dead = report.dead_letter_missing(expected_dead)
        ends = [at for _kind, at in figures.injected[1:]] + [started + args.duration]
        recoveries = [recovery_seconds(flow.times, at, min(end, at + 60))
                      for (_kind, at), end in zip(figures.injected, ends, strict=True)]
        late = checker.late_first_copies(consumer.deliveries)
        details = order_violation_details(consumer.received, late, started, figures.injected)
        by_kind: dict[str, list[float]] = {}
        for (kind, _at), seconds in zip(figures.injected, recoveries, strict=True):
            by_kind.setdefault(kind, []).append(seconds)
        result = {
            "duration_seconds": args.duration, "relays": args.relays, "rate": args.rate,
            "batch_size": args.batch_size, "seed": args.seed, "events": report.produced,
            "delivered": report.delivered, "faults": sum(figures.faults.values()),
            "faults_by_kind": figures.faults,
            "hostile_rows": len(expected_dead),
            "hostile_dead_lettered": len(expected_dead) - len(missing_dead),
            "lost": len(report.lost) + len(missing_dead), "unexpected": len(report.unexpected),
            "duplicated": report.duplicates,
            "duplicated_by_redelivery": redelivered_copies(consumer.received),
            "order_violations": sum(report.order_violations.values()),
            "audit_missing": audit_missing,
            "order_violations_at_consumer": len(late),
            "order_violations_at_consumer_by_redelivery": late_redeliveries(
                late, consumer.received),
            "order_violations_at_consumer_in_reversed_runs": sum(
                bool(d["reversed_run"]) for d in details),
            "order_violation_details": details,
            "left_in_outbox": report.left_in_outbox, "in_doubt_left": report.in_doubt,
            "committed_without_majority": figures.committed_without_majority,
            "longest_in_doubt_seconds": round(tally.max_in_doubt_seconds, 2),
            "unexpected_exits": tally.unexpected_exits,
            "producer_retries": tally.producer_errors,
            "recovery_p50_seconds": round(statistics.median(recoveries), 3) if recoveries else 0,
            "recovery_max_seconds": max(recoveries, default=0.0),
            "recovery_by_kind": {k: {"p50": round(statistics.median(v), 3), "max": max(v)}
                                 for k, v in sorted(by_kind.items())},
        }
        print()
        for name, value in result.items():
            print(f"  {name:<47}{value}")
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        ok = (report.ok(max_duplicates=args.batch_size * max(1, len(recoveries)) * args.relays,
                        dead_letter_expected=expected_dead)
              and audit_missing == 0
              and tally.unexpected_exits == 0 and figures.committed_without_majority == 0)
        print("\nOK: nothing lost, nothing unexpected, nothing left over" if ok
              else f"\nFAILED: {report.summary()} audit_missing={audit_missing}"
                   f" unexpected_exits={tally.unexpected_exits}"
                   f" committed_without_majority={figures.committed_without_majority}")
        if not ok:
            kept = Path(tempfile.gettempdir()) / f"outbox-chaos-cluster-logs-{int(time.time())}"
            shutil.copytree(logdir, kept)
            print(f"relay and resolver logs kept in {kept}")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
