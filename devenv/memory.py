"""A relay's peak memory with huge rows: ``./dev memory`` (or ``python -m devenv.memory``).

Starts its own PostgreSQL and RabbitMQ, starts one relay on an empty outbox and reads its
resident memory once it idles (the baseline), then inserts, in one transaction, rows of
``--row-mb`` MiB each (raw bytes), rows of ``--oversized-mb`` MiB (over
OUTBOX_MAX_MESSAGE_BYTES: the claim moves them to the dead-letter table without fetching them)
and small events, waits until the relay has published or dead-lettered everything, and prints
the relay's peak resident memory (VmHWM) against its baseline and its byte budget
(OUTBOX_BATCH_MAX_BYTES). Linux only (it reads /proc).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pika
import psycopg

from devenv import checker, launch
from devenv.servers import PostgresServer, RabbitServer
from outbox_relay.schema import migrate

MIB = 1 << 20
EXCHANGE = "memory.events"
QUEUE = "memory.sink"


def status_kib(pid: int, field: str) -> int:
    """A /proc/<pid>/status field in KiB (VmRSS: resident now, VmHWM: peak resident)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _count(url: str, table: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    return int(row[0]) if row else 0


def measure(*, rows: int, row_mb: float, oversized: int, oversized_mb: float, small: int,
            budget_mb: float, max_message_mb: float, timeout: float = 600) -> dict[str, Any]:
    """Run the measurement; the figures as a dict (sizes in MiB)."""
    with ExitStack() as stack:
        pg = stack.enter_context(PostgresServer(max_prepared_transactions=8))
        rabbit = stack.enter_context(RabbitServer())
        logdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="outbox-memory-")))
        migrate(pg.url, "outbox")
        conn = pika.BlockingConnection(pika.URLParameters(rabbit.url))
        channel = conn.channel()
        channel.exchange_declare(EXCHANGE, exchange_type="topic", durable=True)
        channel.queue_declare(QUEUE, durable=True)
        channel.queue_bind(QUEUE, EXCHANGE, routing_key="#")
        conn.close()
        env = launch.program_env(pg.url, rabbit.url, OUTBOX_CONFIRM_TIMEOUT="120",
                                 OUTBOX_BATCH_MAX_BYTES=str(int(budget_mb * MIB)),
                                 OUTBOX_MAX_MESSAGE_BYTES=str(int(max_message_mb * MIB)))
        relay = launch.launch("relay", env, logdir / "relay.log")
        stack.callback(relay.wait)
        stack.callback(relay.kill)  # callbacks run last in, first out: kill, then wait
        deadline = time.monotonic() + 60
        while "relay started" not in (logdir / "relay.log").read_text(errors="replace"):
            if relay.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((logdir / "relay.log").read_text(errors="replace"))
            time.sleep(0.2)
        time.sleep(3)  # connected, idling on an empty outbox
        baseline = status_kib(relay.pid, "VmRSS")

        with psycopg.connect(pg.url, autocommit=True) as db, db.transaction():
            produced = checker.insert_events(db, "outbox", small, exchange=EXCHANGE,
                                             routing_key="small", per_transaction=small or 1)
            for kind, count, size in (("big", rows, row_mb), ("oversized", oversized,
                                                              oversized_mb)):
                for n in range(count):
                    db.execute("INSERT INTO outbox (message_id, exchange, routing_key,"
                               " payload_bytes) VALUES (%s, %s, 'big',"
                               " convert_to(repeat('x', %s), 'UTF8'))",
                               (f"{kind}-{n}", EXCHANGE, int(size * MIB)))
                    if kind == "big":
                        produced.append(f"{kind}-{n}")
        started = time.monotonic()
        while _count(pg.url, "outbox") > 0 or _count(pg.url, "pg_prepared_xacts") > 0:
            if relay.poll() is not None:
                raise RuntimeError("the relay exited:\n" + (logdir / "relay.log").read_text())
            if time.monotonic() - started > timeout:
                raise RuntimeError("timed out; relay log in " + str(logdir))
            time.sleep(0.5)
        seconds = time.monotonic() - started
        peak = status_kib(relay.pid, "VmHWM")
        dead = _count(pg.url, "outbox_dead_letter")
        relay.terminate()
        relay.wait(60)
        delivered = checker.drain(rabbit.url, QUEUE, expected=set(produced), total_timeout=300)
        missing = set(produced) - {d.message_id for d in delivered}
        return {
            "rows": rows, "row_mib": row_mb, "oversized_rows": oversized,
            "oversized_mib": oversized_mb, "small_events": small,
            "batch_max_bytes_mib": budget_mb, "max_message_bytes_mib": max_message_mb,
            "baseline_rss_mib": round(baseline / 1024, 1),
            "peak_rss_mib": round(peak / 1024, 1),
            "peak_above_baseline_mib": round((peak - baseline) / 1024, 1),
            "largest_fetched_row_mib": row_mb,
            "seconds": round(seconds, 1), "dead_lettered": dead,
            "missing": len(missing), "delivered": len(delivered),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev memory", description=__doc__)
    parser.add_argument("--rows", type=int, default=6, help="rows of --row-mb (default 6)")
    parser.add_argument("--row-mb", type=float, default=60, help="MiB per big row (60)")
    parser.add_argument("--oversized", type=int, default=2,
                        help="rows over OUTBOX_MAX_MESSAGE_BYTES (2)")
    parser.add_argument("--oversized-mb", type=float, default=150, help="MiB of those (150)")
    parser.add_argument("--small", type=int, default=2000, help="small events (2000)")
    parser.add_argument("--budget-mb", type=float, default=16,
                        help="OUTBOX_BATCH_MAX_BYTES in MiB (16, the default)")
    parser.add_argument("--max-message-mb", type=float, default=128,
                        help="OUTBOX_MAX_MESSAGE_BYTES in MiB (128, the default)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    figures = measure(rows=args.rows, row_mb=args.row_mb, oversized=args.oversized,
                      oversized_mb=args.oversized_mb, small=args.small, budget_mb=args.budget_mb,
                      max_message_mb=args.max_message_mb)
    for name, value in figures.items():
        print(f"  {name:<26}{value:>12}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    ok = figures["missing"] == 0 and figures["dead_lettered"] == args.oversized
    print("\nOK" if ok else "\nFAILED: rows missing or not dead-lettered")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
