"""The chaos run: ``./dev chaos --duration 600`` (or ``python -m devenv.chaos``).

Several relays and a resolver relay a steady stream of events while a loop SIGKILLs relays at
random, crashes and restarts PostgreSQL, and kills or stops and restarts RabbitMQ. At the end
every process is allowed to finish, the queue is drained and the total-queue checker prints:
events, kills, restarts, lost, unexpected, duplicated, order violations, what is left over, and
the longest time a batch waited in doubt.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import psycopg

from devenv import checker
from devenv.servers import PostgresServer, RabbitServer
from relay.migrate import migrate

ROOT = Path(__file__).resolve().parent.parent
EXCHANGE = "chaos.events"
QUEUE = "chaos.sink"
LEDGER = "outbox.ledger"


@dataclass
class Tally:
    relay_kills: int = 0
    postgres_restarts: int = 0
    rabbitmq_restarts: int = 0
    max_in_doubt_seconds: float = 0.0
    produced: list[str] = field(default_factory=list)
    producer_errors: int = 0


class Producer(threading.Thread):
    """Inserts events at a steady rate; retries a failed transaction with the same ids."""

    def __init__(self, url: str, rate: float, stop: threading.Event, tally: Tally) -> None:
        super().__init__(daemon=True)
        self.url, self.rate, self.stop_event, self.tally = url, rate, stop, tally

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
                with conn.transaction():
                    conn.execute(
                        "INSERT INTO outbox (message_id, exchange, routing_key, ordering_key,"
                        " payload) SELECT 'c-' || n, %(ex)s, 'chaos', 'k' || (n %% 32),"
                        " jsonb_build_object('key', 'k' || (n %% 32), 'seq', n,"
                        " 'pad', repeat('x', 160))"
                        " FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) n"
                        " ON CONFLICT (message_id) DO NOTHING",
                        {"ex": EXCHANGE, "lo": seq, "hi": seq + per_tick - 1})
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


def _spawn(name: str, module: str, env: dict[str, str], logdir: Path) -> subprocess.Popen[bytes]:
    with open(logdir / f"{name}.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", module], env=env, cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)


def _scalar(url: str, query: str) -> float:
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
            row = conn.execute(query).fetchone()
            return float(row[0]) if row and row[0] is not None else 0.0
    except psycopg.Error:
        return -1.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev chaos", description=__doc__)
    parser.add_argument("--duration", type=float, default=60, help="seconds of chaos")
    parser.add_argument("--rate", type=float, default=500, help="events per second offered")
    parser.add_argument("--relays", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
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

        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env.update({"OUTBOX_DATABASE_URL": pg.url, "OUTBOX_AMQP_URL": rabbit.url,
                    "OUTBOX_BATCH_SIZE": str(args.batch_size), "OUTBOX_METRICS_PORT": "0",
                    "OUTBOX_CONFIRM_TIMEOUT": "5", "OUTBOX_RECONNECT_MAX_DELAY": "2",
                    "OUTBOX_RESOLVER_INTERVAL": "1", "PYTHONPATH": str(ROOT)})
        relays = [_spawn(f"relay-{i}", "relay", env, logdir) for i in range(args.relays)]
        resolver = _spawn("resolver", "resolver", env, logdir)

        def kill_all() -> None:
            for proc in [*relays, resolver]:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

        stack.callback(kill_all)
        stop = threading.Event()
        producer = Producer(pg.url, args.rate, stop, tally)
        producer.start()

        print(f"chaos for {args.duration:.0f} s: {args.relays} relays, {args.rate:.0f} events/s,"
              f" logs in {logdir}", flush=True)
        started = time.monotonic()
        next_fault = started + rng.uniform(3, 8)
        while time.monotonic() - started < args.duration:
            tally.max_in_doubt_seconds = max(tally.max_in_doubt_seconds, _scalar(
                pg.url, "SELECT extract(epoch FROM now() - min(prepared)) FROM pg_prepared_xacts"))
            if resolver.poll() is not None:
                resolver = _spawn("resolver", "resolver", env, logdir)
            if time.monotonic() >= next_fault:
                fault = rng.choices(["relay", "postgres", "rabbitmq"], weights=[6, 1, 1])[0]
                if fault == "relay":
                    i = rng.randrange(len(relays))
                    relays[i].kill()
                    relays[i].wait()
                    relays[i] = _spawn(f"relay-{i}", "relay", env, logdir)
                    tally.relay_kills += 1
                elif fault == "postgres":
                    pg.stop("immediate")  # a crash: prepared transactions must survive it
                    time.sleep(rng.uniform(0.5, 3))
                    pg.restart()
                    tally.postgres_restarts += 1
                else:
                    if rng.random() < 0.5:
                        rabbit.kill()
                    else:
                        rabbit.stop()
                    time.sleep(rng.uniform(0.5, 3))
                    rabbit.restart()
                    tally.rabbitmq_restarts += 1
                print(f"  {time.monotonic() - started:6.1f} s  fault: {fault}", flush=True)
                next_fault = time.monotonic() + rng.uniform(4, 12)
            time.sleep(0.5)

        stop.set()
        producer.join(30)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            left = _scalar(pg.url, "SELECT count(*) FROM outbox")
            doubt = _scalar(pg.url, "SELECT count(*) FROM pg_prepared_xacts")
            if left == 0 and doubt == 0:
                break
            time.sleep(1)
        for proc in [*relays, resolver]:
            proc.terminate()
            proc.wait(60)

        deliveries = checker.drain(rabbit.url, QUEUE, expected=set(tally.produced),
                                   total_timeout=600)
        with psycopg.connect(pg.url, autocommit=True) as db:
            report = checker.check(tally.produced, deliveries, conn=db, table="outbox")
        figures = {
            "duration_seconds": args.duration, "relays": args.relays, "rate": args.rate,
            "batch_size": args.batch_size, "events": report.produced,
            "delivered": report.delivered, "relay_kills": tally.relay_kills,
            "postgres_restarts": tally.postgres_restarts,
            "rabbitmq_restarts": tally.rabbitmq_restarts,
            "lost": len(report.lost), "unexpected": len(report.unexpected),
            "duplicated": report.duplicates,
            "order_violations": sum(report.order_violations.values()),
            "left_in_outbox": report.left_in_outbox, "dead_lettered": report.dead_lettered,
            "in_doubt_left": report.in_doubt,
            "longest_in_doubt_seconds": round(tally.max_in_doubt_seconds, 2),
            "producer_retries": tally.producer_errors,
        }
        print()
        for name, value in figures.items():
            print(f"  {name:<26}{value:>12}")
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2) + "\n")
        faults = tally.relay_kills + tally.postgres_restarts + tally.rabbitmq_restarts
        ok = report.ok(max_duplicates=args.batch_size * max(1, faults) * args.relays)
        print("\nOK: nothing lost, nothing unexpected, nothing left over" if ok
              else f"\nFAILED: {report.summary()} (logs in {logdir})")
        if not ok:
            kept = Path(tempfile.gettempdir()) / f"outbox-chaos-logs-{int(time.time())}"
            shutil.copytree(logdir, kept)
            print(f"relay and resolver logs kept in {kept}")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
