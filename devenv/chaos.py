"""The chaos run: ``./dev chaos --duration 600`` (or ``python -m devenv.chaos``).

Several relays and a resolver relay a steady stream of events while a loop SIGKILLs relays at
random, crashes and restarts PostgreSQL, kills or stops and restarts RabbitMQ, and cuts or
black-holes their connections (the relays and the resolver reach both servers through loopback
proxies, devenv/proxy.py). A second producer mixes hostile rows into the traffic at random
(headers nested thousands deep or over frame_max, created_at 'infinity', BC or year 10000,
records forged for the ledger, oversized payloads...): each must end in the dead-letter table,
none may be published or stop a relay. At the end every process is allowed to finish, the queue
is drained and the total-queue checker prints: events, kills, restarts, cuts, lost (events not
delivered and hostile rows not dead-lettered), unexpected, duplicated, order violations, what is
left over, and the longest time a batch waited in doubt.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import psycopg
from psycopg.types.json import Jsonb

from devenv import checker, launch
from devenv.proxy import Proxy
from devenv.servers import PostgresServer, RabbitServer
from outbox_relay.schema import migrate

EXCHANGE = "chaos.events"
QUEUE = "chaos.sink"
LEDGER = "outbox.ledger"
MAX_MESSAGE_BYTES = 256 * 1024  # the relays' OUTBOX_MAX_MESSAGE_BYTES in the chaos run

# Hostile rows: {kind: the columns a buggy or malicious producer writes}. Each can never be
# published; every one must end in the dead-letter table, whatever the faults.
HOSTILE: dict[str, dict[str, Any]] = {
    "nested_headers": {"headers": "NESTED"},
    "headers_not_object": {"headers": Jsonb(["not", "an", "object"])},
    "headers_over_frame_max": {"headers": Jsonb({"big": "x" * 200_000})},
    "header_int_too_big": {"headers": Jsonb({"n": 2**70})},
    # The relay's order headers on a keyless row, at the largest position: an inbox with the
    # per-key check would skip every later event of the key (issue 32).
    "forged_order_headers": {"headers": Jsonb({"x-ordering-key": "k1", "x-outbox-id": 2**63 - 1})},
    "created_infinity": {"created_at": "infinity"},
    "created_minus_infinity": {"created_at": "-infinity"},
    "created_bc": {"created_at": "4713-01-01 00:00:00+00 BC"},
    "created_year_10000": {"created_at": "10000-01-01 00:00:00+00"},
    "created_1960": {"created_at": "1960-01-01 00:00:00+00"},
    "forged_ledger_default_exchange": {"exchange": "", "routing_key": LEDGER, "payload": "FORGED"},
    "forged_ledger_exchange": {"exchange": LEDGER, "routing_key": LEDGER, "payload": "FORGED"},
    "oversized_payload": {"payload_bytes": b"\x00" * (MAX_MESSAGE_BYTES + 1)},
    "long_routing_key": {"routing_key": "r" * 300},
}


@dataclass
class Tally:
    relay_kills: int = 0
    postgres_restarts: int = 0
    rabbitmq_restarts: int = 0
    connection_cuts: int = 0
    black_holes: int = 0
    # Relays or resolvers that exited without being killed: a bug, whatever the checker says.
    unexpected_exits: int = 0
    max_in_doubt_seconds: float = 0.0
    produced: list[str] = field(default_factory=list)
    producer_errors: int = 0
    hostile: list[str] = field(default_factory=list)  # message ids: expected in dead letter
    forged_records: int = 0  # forged records appended to the ledger stream directly

    @property
    def faults(self) -> int:
        return (self.relay_kills + self.postgres_restarts + self.rabbitmq_restarts
                + self.connection_cuts + self.black_holes)


class Producer(threading.Thread):
    """Inserts events at a steady rate; retries a failed transaction with the same ids."""

    def __init__(self, url: str, rate: float, stop: threading.Event, tally: Tally) -> None:
        super().__init__(daemon=True)
        self.url, self.rate, self.stop_event, self.tally = url, rate, stop, tally
        # Held from BEGIN until ``tally.produced`` has the committed ids: a reader holding it
        # sees the table and the tally agree (the cluster run's flow sampling).
        self.lock = threading.Lock()

    def _insert(self, conn: psycopg.Connection[Any], seq: int, count: int) -> None:
        with conn.transaction():
            conn.execute(
                "INSERT INTO outbox (message_id, exchange, routing_key, ordering_key,"
                " payload) SELECT 'c-' || n, %(ex)s, 'chaos', 'k' || (n %% 32),"
                " jsonb_build_object('key', 'k' || (n %% 32), 'seq', n,"
                " 'pad', repeat('x', 160))"
                " FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) n"
                " ON CONFLICT (message_id) DO NOTHING",
                {"ex": EXCHANGE, "lo": seq, "hi": seq + count - 1})

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        tick = 0.05
        per_tick = max(1, round(self.rate * tick))
        seq = 0
        next_at = time.monotonic()
        while not self.stop_event.is_set():
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(self.url, autocommit=True, connect_timeout=2)
                with self.lock:
                    self._insert(conn, seq, per_tick)
                    # After the commit: ids whose commit failed are retried, not counted.
                    self.tally.produced.extend(f"c-{n}" for n in range(seq, seq + per_tick))
                seq += per_tick
            except psycopg.Error:
                # Outcome unknown: retry the same ids; ON CONFLICT makes the retry idempotent.
                self.tally.producer_errors += 1
                conn = None
                time.sleep(0.2)
                continue
            next_at += tick
            time.sleep(max(0.0, next_at - time.monotonic()))


class HostileProducer(threading.Thread):
    """Inserts a hostile row of a random kind every ``gap`` seconds on average, committed or
    retried with the same message id (ON CONFLICT makes a retry after a lost commit safe).

    Forged ledger records name a batch that is in doubt right now (pg_prepared_xacts is
    readable by everyone), its real xid included. Now and then one is also appended to the
    stream directly, as another broker user would: the resolver must reject it.
    """

    def __init__(self, url: str, amqp_url: str, gap: float, stop: threading.Event, tally: Tally,
                 rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.url, self.amqp_url, self.gap = url, amqp_url, gap
        self.stop_event, self.tally, self.rng = stop, tally, rng

    def _in_doubt(self, conn: psycopg.Connection[Any] | None) -> tuple[str, int]:
        row = None
        if conn is not None:
            row = conn.execute("SELECT gid, transaction::text::bigint FROM pg_prepared_xacts"
                               " ORDER BY random() LIMIT 1").fetchone()
        return (str(row[0]), int(row[1])) if row else ("outbox:00000001:1", 1)

    def _forged(self, conn: psycopg.Connection[Any] | None) -> dict[str, Any]:
        gid, xid = self._in_doubt(conn)
        return {"type": "batch", "v": 1, "gid": gid, "xid": xid, "database": "outbox",
                "count": 1, "relay": "forged", "mac": f"{self.rng.getrandbits(256):064x}"}

    def _forge_in_stream(self, conn: psycopg.Connection[Any] | None) -> None:
        try:
            amqp = pika.BlockingConnection(pika.URLParameters(self.amqp_url))
            try:
                amqp.channel().basic_publish("", LEDGER, json.dumps(self._forged(conn)).encode())
            finally:
                amqp.close()
            self.tally.forged_records += 1
        except (pika.exceptions.AMQPError, OSError):
            pass

    def _columns(self, kind: str, n: int, conn: psycopg.Connection[Any] | None) -> dict[str, Any]:
        columns: dict[str, Any] = {"message_id": f"h-{n}-{kind}", "exchange": EXCHANGE,
                                   "routing_key": "chaos", "payload": Jsonb({"hostile": kind})}
        columns.update(HOSTILE[kind])
        if columns.get("headers") == "NESTED":
            columns["headers"] = '{"a":' * 5000 + "1" + "}" * 5000
        if columns.get("payload") == "FORGED":
            columns["payload"] = Jsonb(self._forged(conn))
        if "payload_bytes" in columns:
            columns["payload"] = None
        return columns

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        n = 0
        pending: dict[str, Any] | None = None
        deadline = float("inf")
        while time.monotonic() < deadline:
            if self.stop_event.wait(self.rng.uniform(0, 2 * self.gap)):
                # Stopped: only a row whose insert may have failed is still written (for 30 s),
                # so every hostile row in the table is one the checker expects.
                if pending is None:
                    break
                deadline = min(deadline, time.monotonic() + 30)
                time.sleep(0.2)
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(self.url, autocommit=True, connect_timeout=2)
                if pending is None and self.rng.random() < 0.2:
                    self._forge_in_stream(conn)
                    continue
                if pending is None:
                    n += 1
                    pending = self._columns(self.rng.choice(sorted(HOSTILE)), n, conn)
                names = list(pending)
                casts = {"headers": "::jsonb", "created_at": "::timestamptz"}
                values = ", ".join(f"%({name})s{casts.get(name, '')}" for name in names)
                conn.execute(f"INSERT INTO outbox ({', '.join(names)}) VALUES ({values})"
                             " ON CONFLICT (message_id) DO NOTHING", pending)
            except psycopg.Error:
                self.tally.producer_errors += 1
                conn = None
                continue
            self.tally.hostile.append(pending["message_id"])
            pending = None
        if conn is not None:
            conn.close()


# Faults and their weights: relay kills are cheap and the most telling, server restarts slow.
FAULTS = {"relay": 6, "postgres": 1, "rabbitmq": 1, "cut": 3, "blackhole": 1}


@dataclass
class Injector:
    """Applies one fault of FAULTS and counts it."""

    rng: random.Random
    tally: Tally
    pg: PostgresServer
    rabbit: RabbitServer
    pg_proxy: Proxy
    mq_proxy: Proxy
    spawn_relay: Callable[[int], subprocess.Popen[bytes]]
    procs: list[subprocess.Popen[bytes]]  # the relays first, then the resolver
    relay_count: int

    def inject(self, fault: str) -> None:
        getattr(self, f"_{fault}")()

    def _relay(self) -> None:
        i = self.rng.randrange(self.relay_count)
        self.procs[i].kill()
        self.procs[i].wait()
        self.procs[i] = self.spawn_relay(i)
        self.tally.relay_kills += 1

    def _postgres(self) -> None:
        self.pg.stop("immediate")  # a crash: prepared transactions must survive it
        time.sleep(self.rng.uniform(0.5, 3))
        self.pg.restart()
        self.tally.postgres_restarts += 1

    def _rabbitmq(self) -> None:
        if self.rng.random() < 0.5:
            self.rabbit.kill()
        else:
            self.rabbit.stop()
        time.sleep(self.rng.uniform(0.5, 3))
        self.rabbit.restart()
        self.tally.rabbitmq_restarts += 1

    def _cut(self) -> None:
        both = [self.pg_proxy, self.mq_proxy]
        for proxy in self.rng.choice([both[:1], both[1:], both]):
            proxy.cut()
        self.tally.connection_cuts += 1

    def _blackhole(self) -> None:
        """A partition: nothing answers for a while, then the held connections are dropped."""
        proxy = self.rng.choice([self.pg_proxy, self.mq_proxy])
        proxy.blackhole()
        time.sleep(self.rng.uniform(1, 6))
        proxy.heal()
        self.tally.black_holes += 1


def _spawn(name: str, module: str, env: dict[str, str], logdir: Path) -> subprocess.Popen[bytes]:
    return launch.launch(module, env, logdir / f"{name}.log", append=True)  # respawns append


def _scalar(url: str, query: str) -> float:
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
            row = conn.execute(query).fetchone()
            return float(row[0]) if row and row[0] is not None else 0.0
    except psycopg.Error:
        return -1.0


def _watch_in_doubt(url: str, watching: threading.Event, tally: Tally) -> None:
    """Sample the age of the oldest prepared transaction, faults and drain included."""
    query = "SELECT extract(epoch FROM now() - min(prepared)) FROM pg_prepared_xacts"
    while watching.is_set():
        tally.max_in_doubt_seconds = max(tally.max_in_doubt_seconds, _scalar(url, query))
        time.sleep(0.25)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev chaos", description=__doc__)
    parser.add_argument("--duration", type=float, default=60, help="seconds of chaos")
    parser.add_argument("--rate", type=float, default=500, help="events per second offered")
    parser.add_argument("--relays", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--fault-gap", type=float, nargs=2, default=(4.0, 12.0),
                        metavar=("MIN", "MAX"), help="seconds between faults (default: 4 12)")
    parser.add_argument("--cycle", action="store_true",
                        help="inject every kind of fault in turn instead of at random by weight")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--hostile-gap", type=float, default=1.0, metavar="SECONDS",
                        help="mean seconds between hostile rows (0: none; default: 1)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    tally = Tally()

    with ExitStack() as stack:
        pg = stack.enter_context(PostgresServer(max_prepared_transactions=32))
        rabbit = stack.enter_context(RabbitServer())
        logdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="outbox-chaos-")))
        migrate(pg.url, "outbox")
        conn = pika.BlockingConnection(pika.URLParameters(rabbit.url))
        channel = conn.channel()
        channel.exchange_declare(EXCHANGE, exchange_type="topic", durable=True)
        channel.queue_declare(QUEUE, durable=True)
        channel.queue_bind(QUEUE, EXCHANGE, routing_key="#")
        # RabbitMQ 3.10 loses a stream killed within ~1 s of its first declaration.
        channel.queue_declare(LEDGER, durable=True,
                              arguments={"x-queue-type": "stream", "x-max-age": "7D"})
        conn.close()
        time.sleep(1.5)

        # Relays and resolver go through proxies the fault loop can cut; the producer does not.
        pg_proxy = stack.enter_context(Proxy.to(pg.url))
        mq_proxy = stack.enter_context(Proxy.to(rabbit.url))
        env = launch.program_env(
            pg_proxy.url(pg.url), mq_proxy.url(rabbit.url),
            OUTBOX_BATCH_SIZE=str(args.batch_size), OUTBOX_CONFIRM_TIMEOUT="5",
            OUTBOX_RECONNECT_MAX_DELAY="2", OUTBOX_MAX_MESSAGE_BYTES=str(MAX_MESSAGE_BYTES),
            OUTBOX_RESOLVER_INTERVAL="1")
        names = [*(f"relay-{i}" for i in range(args.relays)), "resolver"]
        procs = [_spawn(name, name.split("-")[0], env, logdir) for name in names]

        injector = Injector(rng, tally, pg, rabbit, pg_proxy, mq_proxy,
                            lambda i: _spawn(f"relay-{i}", "relay", env, logdir), procs, args.relays)

        def respawn_exited() -> None:
            for i, proc in enumerate(procs):
                if proc.poll() is not None:
                    tally.unexpected_exits += 1
                    print(f"  {names[i]} exited by itself ({proc.returncode}); restarted",
                          flush=True)
                    procs[i] = _spawn(names[i], names[i].split("-")[0], env, logdir)

        def kill_all() -> None:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

        stack.callback(kill_all)
        stop, watching = threading.Event(), threading.Event()
        watching.set()
        producer = Producer(pg.url, args.rate, stop, tally)
        producer.start()
        hostile = HostileProducer(pg.url, rabbit.url, args.hostile_gap, stop, tally,
                                  random.Random(rng.random()))
        if args.hostile_gap > 0:
            hostile.start()
        watch = threading.Thread(target=_watch_in_doubt, args=(pg.url, watching, tally),
                                 daemon=True)
        watch.start()

        print(f"chaos for {args.duration:.0f} s: {args.relays} relays, {args.rate:.0f} events/s,"
              f" logs in {logdir}", flush=True)
        started = time.monotonic()
        next_fault = started + rng.uniform(*args.fault_gap)
        cycle = list(FAULTS)
        while time.monotonic() - started < args.duration:
            respawn_exited()
            if time.monotonic() >= next_fault:
                if args.cycle:
                    fault = cycle[tally.faults % len(cycle)]
                else:
                    fault = rng.choices(list(FAULTS), weights=list(FAULTS.values()))[0]
                injector.inject(fault)
                print(f"  {time.monotonic() - started:6.1f} s  fault: {fault}", flush=True)
                next_fault = time.monotonic() + rng.uniform(*args.fault_gap)
            time.sleep(0.5)

        stop.set()
        producer.join(30)
        if hostile.is_alive():
            hostile.join(30)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            left = _scalar(pg.url, "SELECT count(*) FROM outbox")
            doubt = _scalar(pg.url, "SELECT count(*) FROM pg_prepared_xacts")
            if left == 0 and doubt == 0:
                break
            respawn_exited()
            time.sleep(1)
        watching.clear()
        watch.join(10)
        for proc in procs:
            proc.terminate()
            proc.wait(60)

        deliveries = checker.drain(rabbit.url, QUEUE, expected=set(tally.produced),
                                   total_timeout=600)
        with psycopg.connect(pg.url, autocommit=True) as db:
            report = checker.check(tally.produced, deliveries, conn=db, table="outbox")
        expected_dead = set(tally.hostile)
        missing_dead = report.dead_letter_missing(expected_dead)
        figures = {
            "duration_seconds": args.duration, "relays": args.relays, "rate": args.rate,
            "batch_size": args.batch_size, "events": report.produced,
            "delivered": report.delivered, "relay_kills": tally.relay_kills,
            "postgres_restarts": tally.postgres_restarts,
            "rabbitmq_restarts": tally.rabbitmq_restarts,
            "connection_cuts": tally.connection_cuts, "black_holes": tally.black_holes,
            "hostile_rows": len(expected_dead), "forged_ledger_records": tally.forged_records,
            "hostile_dead_lettered": len(expected_dead) - len(missing_dead),
            "lost": len(report.lost) + len(missing_dead), "unexpected": len(report.unexpected),
            "duplicated": report.duplicates,
            "order_violations": sum(report.order_violations.values()),
            "left_in_outbox": report.left_in_outbox, "dead_lettered": report.dead_lettered,
            "in_doubt_left": report.in_doubt,
            "longest_in_doubt_seconds": round(tally.max_in_doubt_seconds, 2),
            "producer_retries": tally.producer_errors,
            "unexpected_exits": tally.unexpected_exits,
        }
        print()
        for name, value in figures.items():
            print(f"  {name:<26}{value:>12}")
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2) + "\n")
        faults = tally.faults
        ok = (report.ok(max_duplicates=args.batch_size * max(1, faults) * args.relays,
                        dead_letter_expected=expected_dead)
              and tally.unexpected_exits == 0)
        print("\nOK: nothing lost, nothing unexpected, nothing left over" if ok
              else f"\nFAILED: {report.summary()} unexpected_exits={tally.unexpected_exits}"
                 f" (logs in {logdir})")
        if not ok:
            kept = Path(tempfile.gettempdir()) / f"outbox-chaos-logs-{int(time.time())}"
            shutil.copytree(logdir, kept)
            print(f"relay and resolver logs kept in {kept}")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
