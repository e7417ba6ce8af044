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
import random
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pika
import pika.exceptions
import psycopg

from devenv import checker
from devenv.chaos_run import (
    LEDGER,
    QUEUE,
    Injector,
    Producer,
    Programs,
    Run,
    Verdict,
    prepare,
)
from devenv.proxy import LOOPBACK, Proxy
from devenv.servers import PostgresPair, RabbitCluster, RabbitServer, start_together

AUDIT = "chaos.audit"  # a copy of every event, read after the run: the broker's order


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
class ClusterInjector(Injector):
    """The cluster's faults, besides the relay kills, cuts and black holes."""

    figures: Figures
    cluster: RabbitCluster
    pair: PostgresPair
    # One proxy per PostgreSQL port (the pair keeps its two ports), for a black hole on the
    # primary.
    pg_proxies: dict[int, Proxy]
    # Nodes being restarted in the background: a RabbitMQ node takes 10-20 s to boot here, and
    # the relay and PostgreSQL faults need not wait for it (the next RabbitMQ fault does).
    restarts: list[threading.Thread] = field(default_factory=list)
    flow: Flow | None = None  # the relays' commits, for the no-majority check

    def inject(self, fault: str) -> None:
        if fault not in ("relay", "promote", "postgres", "cut", "blackhole"):
            self.wait_restarts()
        self.figures.injected.append((fault, time.monotonic()))
        super().inject(fault)
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

    def partitionable(self) -> list[Proxy]:
        """A partition of one server: a RabbitMQ node (its peers and the other relays carry
        on) or the PostgreSQL primary (every relay waits)."""
        mq_proxies, _pg = self.cut_groups
        return [*mq_proxies, self.pg_proxies[self.pair.primary.port]]


class ClusterRun(Run):
    """3 RabbitMQ nodes and a PostgreSQL primary with a synchronous standby; the sink a quorum
    queue read all along by a consumer, the audit queue read after the run."""

    title = "cluster chaos"
    prog = "./dev chaos --cluster"
    # Node kills the most, the slow ones (promotion, no majority) less.
    faults: ClassVar[dict[str, int]] = {
        "relay": 3, "connected_node": 2, "ledger_leader": 2, "sink_leader": 2,
        "node_restart": 1, "no_majority": 1, "promote": 1, "postgres": 1, "cut": 2,
        "blackhole": 1}
    # In turn: the slow checks first, and RabbitMQ faults (which wait for the last node's
    # restart) between the others, so a short run covers the most kinds.
    cycle = ("no_majority", "relay", "promote", "cut", "connected_node", "blackhole",
             "postgres", "ledger_leader", "sink_leader", "node_restart")
    rate = 300.0
    fault_gap = (5.0, 12.0)
    hostile_gap = 2.0
    settings: ClassVar[dict[str, str]] = {"OUTBOX_CONNECT_TIMEOUT": "3"}
    drain_seconds = 240.0
    row = "  {name:<47}{value}"
    kept_logs = "outbox-chaos-cluster-logs"

    pair: PostgresPair
    cluster: RabbitCluster
    faulter: ClusterInjector
    consumer: Consumer
    flow: Flow

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.figures = Figures()
        self.consuming = threading.Event()  # set: the consumer and the flow sampling stop

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--kinds", type=lambda text: text.split(","), default=None,
                            metavar="KIND,KIND", help="inject only these kinds of fault "
                            f"(default: all of {', '.join(cls.faults)})")
        parser.add_argument("--single-active-consumer", action="store_true",
                            help="declare the sink with single active consumer (default: a "
                            "plain queue, the consumer reconnecting to any node)")

    @classmethod
    def check_arguments(cls, parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        unknown = set(args.kinds or ()) - set(cls.faults)
        if unknown:
            parser.error(f"--kinds: unknown kind(s) {', '.join(sorted(unknown))}")

    def kinds(self) -> list[str]:
        return list(self.args.kinds or self.faults)

    def start(self, stack: ExitStack) -> tuple[str, str]:
        started = time.monotonic()
        self.pair = PostgresPair(sync=True, max_prepared_transactions=64)
        stack.callback(self.pair.cleanup)
        self.cluster = RabbitCluster(3)
        stack.callback(self.cluster.cleanup)
        start_together(self.pair.start, self.cluster.start)
        self.database_url, self.amqp_url = self.pair.url, self.cluster.urls[0]
        prepare(self.pair.url, self.cluster.urls[0], {
            # A plain consumer that reconnects can break per-key order itself
            # (docs/reliability.md: messages it held come back after newer ones);
            # --single-active-consumer is the README's advice, but short runs with it still
            # counted violations (not explained yet).
            QUEUE: {"x-queue-type": "quorum",
                    "x-single-active-consumer": self.args.single_active_consumer},
            # Nobody consumes the audit queue during the run, so no fault can touch its
            # deliveries: read on a calm cluster at the end, it has the events in the order
            # they reached the broker (a relay's confirm waits for both queues).
            AUDIT: {"x-queue-type": "quorum"},
        }, {"x-initial-cluster-size": 3})
        print(f"servers up in {time.monotonic() - started:.0f} s", flush=True)

        # The relays and the resolver reach each RabbitMQ node and each PostgreSQL host
        # through a proxy of its own.
        self.mq_proxies = [stack.enter_context(Proxy.to(url)) for url in self.cluster.urls]
        self.pg_proxies = {server.port: stack.enter_context(Proxy(LOOPBACK, server.port))
                           for server in (self.pair.primary, self.pair.standby)}
        hosts = ",".join(f"{LOOPBACK}:{proxy.port}" for proxy in self.pg_proxies.values())
        return self.pair.url_via(hosts), ",".join(
            proxy.url(url) for proxy, url in zip(self.mq_proxies, self.cluster.urls, strict=True))

    def neighbour_amqp_url(self) -> str:
        return self.cluster.url  # every node: the first that answers

    def injector(self, programs: Programs) -> Injector:
        self.faulter = ClusterInjector(
            self.rng, self.tally, programs, (self.mq_proxies, list(self.pg_proxies.values())),
            self.figures, self.cluster, self.pair, self.pg_proxies)
        return self.faulter

    def watch(self, producer: Producer) -> None:
        self.consumer = Consumer(self.cluster, self.consuming)
        self.consumer.start()
        self.flow = Flow(lambda: self.pair.url, producer, self.consuming)
        self.flow.start()
        self.faulter.flow = self.flow

    def before_drain(self) -> None:
        self.faulter.wait_restarts()  # every node back for the drain
        for node in self.cluster.nodes:
            if not node.running:
                node.restart()

    def collect(self) -> Verdict:
        args, tally, figures, consumer = self.args, self.tally, self.figures, self.consumer
        expected = set(tally.produced)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not expected <= {
                d.message_id for d in consumer.deliveries}:
            time.sleep(1)
        while time.monotonic() - consumer.idle_since < 3:
            time.sleep(0.5)
        self.consuming.set()
        consumer.join(10)
        with psycopg.connect(self.pair.url, autocommit=True) as db:
            report = checker.check(tally.produced, consumer.deliveries, conn=db, table="outbox")
        audit = checker.drain(self.cluster.url, AUDIT, expected=expected, total_timeout=300)
        audit_missing = len(expected - {d.message_id for d in audit})
        # Per-key order is judged where the relays' guarantee holds: at the broker.
        report = dataclasses.replace(report, order_violations=dict(
            Counter(key for _i, key in checker.late_first_copies(audit))))
        expected_dead = set(tally.hostile)
        missing_dead = report.dead_letter_missing(expected_dead)
        started = self.started
        ends = [at for _kind, at in figures.injected[1:]] + [started + args.duration]
        recoveries = [recovery_seconds(self.flow.times, at, min(end, at + 60))
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
        return Verdict(result, report, expected_dead, {
            "audit_missing": audit_missing, "unexpected_exits": tally.unexpected_exits,
            "committed_without_majority": figures.committed_without_majority})


def main(argv: list[str] | None = None) -> int:
    return ClusterRun.main(argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
