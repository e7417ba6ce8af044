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
from dataclasses import dataclass
from pathlib import Path

import pika
import psycopg

from devenv import checker, launch
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
from devenv.proxy import Proxy
from devenv.servers import PostgresServer, RabbitServer
from outbox_relay.schema import migrate

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
        procs = [spawn(name, name.split("-")[0], env, logdir) for name in names]

        injector = Injector(rng, tally, pg, rabbit, pg_proxy, mq_proxy,
                            lambda i: spawn(f"relay-{i}", "relay", env, logdir), procs, args.relays)

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
        stop, watching = threading.Event(), threading.Event()
        watching.set()
        producer = Producer(pg.url, args.rate, stop, tally)
        producer.start()
        hostile = HostileProducer(pg.url, rabbit.url, args.hostile_gap, stop, tally,
                                  random.Random(rng.random()))
        if args.hostile_gap > 0:
            hostile.start()
        watch = threading.Thread(target=watch_in_doubt, args=(pg.url, watching, tally),
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
            left = scalar(pg.url, "SELECT count(*) FROM outbox")
            doubt = scalar(pg.url, "SELECT count(*) FROM pg_prepared_xacts")
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
