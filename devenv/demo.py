"""The end-to-end demo: ``./dev demo`` (or ``python -m devenv.demo``).

Starts a PostgreSQL (2PC on) and a RabbitMQ of its own, produces events with plain INSERTs,
runs two relays and a resolver, kills one relay with SIGKILL in the middle of a batch, and
prints what the checker finds: produced / delivered / lost / duplicates / throughput.
"""

from __future__ import annotations

import argparse
import os
import re
import select
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pika
import psycopg

from devenv import checker, launch
from devenv.servers import PostgresServer, RabbitServer
from outbox_relay.schema import migrate

EXCHANGE = "demo.events"
QUEUE = "demo.sink"


def _count(db: psycopg.Connection[Any], query: str, params: dict[str, str] | None = None) -> int:
    row = db.execute(query, params).fetchone()
    return int(row[0]) if row else 0


def _instance(log_path: Path, relay: subprocess.Popen[bytes], deadline: float) -> str:
    """The relay's instance id, from its start-up line (its gids are outbox:<instance>:<n>)."""
    while time.monotonic() < deadline:
        found = re.search(r"action=relay_started instance=(\w+)",
                          log_path.read_text(errors="replace"))
        if found:
            return found.group(1)
        if relay.poll() is not None:
            break
        time.sleep(0.02)
    raise RuntimeError(f"relay-1 did not start: see {log_path}")


def _exit_time(proc: subprocess.Popen[bytes], deadline: float) -> float | None:
    """When ``proc`` ended (the kernel wakes us at once: a pidfd, not a poll), or None."""
    fd = os.pidfd_open(proc.pid)
    try:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
    finally:
        os.close(fd)
    return time.monotonic() if ready else None


def _finished_at(db: psycopg.Connection[Any], gid_head: str, deadline: float) -> float | None:
    """When no transaction prepared under ``gid_head`` is left (looked at every 10 ms)."""
    while time.monotonic() < deadline:
        if _count(db, "SELECT count(*) FROM pg_prepared_xacts WHERE starts_with(gid, %(head)s)",
                  {"head": gid_head}) == 0:
            return time.monotonic()
        time.sleep(0.01)
    return None


def _spawn(name: str, module: str, env: dict[str, str], logdir: Path) -> subprocess.Popen[bytes]:
    return launch.launch(module, env, logdir / f"{name}.log")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev demo", description=__doc__)
    parser.add_argument("--events", type=int, default=20_000, help="events to produce")
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--database-url", default=os.environ.get("OUTBOX_DEMO_DATABASE_URL"),
                        help="use this PostgreSQL (2PC on) instead of starting one")
    parser.add_argument("--amqp-url", default=os.environ.get("OUTBOX_DEMO_AMQP_URL"),
                        help="use this RabbitMQ instead of starting one")
    args = parser.parse_args(argv)

    with ExitStack() as stack:
        print("starting PostgreSQL and RabbitMQ ...", flush=True)
        db_url = args.database_url or stack.enter_context(PostgresServer()).url
        amqp_url = args.amqp_url or stack.enter_context(RabbitServer()).url
        logdir = Path(stack.enter_context(_tempdir()))
        return run(args, db_url, amqp_url, logdir, stack)


def _tempdir() -> Any:
    import tempfile

    return tempfile.TemporaryDirectory(prefix="outbox-demo-")


def _kill_all(processes: list[subprocess.Popen[bytes]]) -> None:
    for proc in processes:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run(args: argparse.Namespace, db_url: str, amqp_url: str, logdir: Path,
        stack: ExitStack) -> int:
    migrate(db_url, "outbox")
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    channel = conn.channel()
    channel.exchange_declare(EXCHANGE, exchange_type="topic", durable=True)
    channel.queue_declare(QUEUE, durable=True)
    channel.queue_purge(QUEUE)
    channel.queue_bind(QUEUE, EXCHANGE, routing_key="#")
    conn.close()

    with psycopg.connect(db_url, autocommit=True) as db:
        db.execute("TRUNCATE outbox, outbox_dead_letter")
        print(f"producing {args.events} events with plain INSERTs ...", flush=True)
        # Ten events per order, the order's id as their ordering key (published in order):
        # two relays share the orders, and each order's events wait for its batch in flight.
        produced = checker.insert_events(db, "outbox", args.events, exchange=EXCHANGE,
                                         routing_key="order.created",
                                         prefix=f"demo{int(time.time())}",
                                         keys=max(1, args.events // 10))

    env = launch.program_env(db_url, amqp_url, OUTBOX_BATCH_SIZE=str(args.batch_size))
    started = time.monotonic()
    # Relay 1 kills itself after its 5th batch is confirmed and before the ledger record:
    # the worst moment, when the broker has the messages and PostgreSQL has not committed.
    doomed = _spawn("relay-1", "relay", {**env, "OUTBOX_TEST_CRASH_AT": "after_publish",
                                         "OUTBOX_TEST_CRASH_AFTER": "4"}, logdir)
    healthy = _spawn("relay-2", "relay", env, logdir)
    resolver = _spawn("resolver", "resolver", env, logdir)  # default settings
    processes = [doomed, healthy, resolver]
    stack.callback(_kill_all, processes)

    deadline = time.monotonic() + 300
    instance = _instance(logdir / "relay-1.log", doomed, deadline)
    killed_at = _exit_time(doomed, deadline)
    recovered_at = None
    with psycopg.connect(db_url, autocommit=True) as db:
        if killed_at is not None:
            print(f"relay-1 was killed with SIGKILL after {killed_at - started:.2f} s, "
                  "holding a prepared batch whose messages the broker already has", flush=True)
            # Its batch only: the healthy relay has a batch of its own prepared most of the time.
            recovered_at = _finished_at(db, f"outbox:{instance}:", deadline)
        if recovered_at is not None and killed_at is not None:
            print(f"the resolver finished the dead relay's batch {recovered_at - killed_at:.2f} s "
                  "after the kill", flush=True)
        while time.monotonic() < deadline and killed_at is not None:
            if _count(db, "SELECT count(*) FROM outbox") == 0 and _count(
                    db, "SELECT count(*) FROM pg_prepared_xacts") == 0:
                break
            time.sleep(0.05)
    elapsed = time.monotonic() - started
    for proc in processes:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)

    deliveries = checker.drain(amqp_url, QUEUE, expected=set(produced))
    with psycopg.connect(db_url, autocommit=True) as db:
        report = checker.check(produced, deliveries, conn=db, table="outbox")
    rows = [
        ("produced", report.produced),
        ("delivered", report.delivered),
        ("lost", len(report.lost)),
        ("duplicates", report.duplicates),
        ("unexpected", len(report.unexpected)),
        ("left in outbox", report.left_in_outbox),
        ("prepared in doubt", report.in_doubt),
        ("relays killed", 1 if killed_at else 0),
        ("recovery after kill (s)", f"{recovered_at - killed_at:.2f}"
         if killed_at and recovered_at else "n/a"),
        ("elapsed (s)", f"{elapsed:.2f}"),
        ("throughput (events/s)", f"{report.produced / elapsed:,.0f}"),
    ]
    print()
    for name, value in rows:
        print(f"  {name:<26}{value:>12}")
    print()
    ok = report.ok(max_duplicates=args.batch_size)
    print("OK: nothing lost; duplicates only from the killed relay's batch, same message_id"
          if ok else f"FAILED: {report.summary()} (logs in {logdir})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
