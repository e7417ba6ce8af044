"""A relay's peak memory with huge and hostile rows: ``./dev memory`` (or ``python -m
devenv.memory``).

Starts its own PostgreSQL and RabbitMQ, starts one relay on an empty outbox and reads its
resident memory once it idles (the baseline), then inserts, in one transaction, rows of
``--row-mb`` MiB each (raw bytes), rows of ``--oversized-mb`` MiB (over
OUTBOX_MAX_MESSAGE_BYTES: the claim moves them to the dead-letter table without fetching them),
small events, with ``--hostile`` the hostile rows of docs/reliability.md and headers of 10 MiB,
and with ``--near-frame-max N`` publishable header tables just under frame_max; waits until the
relay has published or dead-lettered everything, and prints the relay's peak resident memory
(VmHWM) against its baseline and against the bound of docs/reliability.md#memory for its
settings (``bound_bytes``). Linux only (it reads /proc).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Collection
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import pika
import psycopg

from devenv import checker, launch
from devenv.servers import PostgresServer, RabbitServer
from outbox_relay.relay.settings import RelaySettings
from outbox_relay.relay.store import ROW_HEADROOM
from outbox_relay.schema import migrate

MIB = 1 << 20
EXCHANGE = "memory.events"
QUEUE = "memory.sink"

# The hostile rows of --hostile: those of docs/reliability.md's table that a relay fetches
# (message_id, the columns as SQL over %(exchange)s and %(limit)s, OUTBOX_MAX_MESSAGE_BYTES),
# and headers of 10 MiB of JSON text, valid jsonb, in the shapes that cost Python the most to
# decode and encode (issue 32: a 10 MiB array of zeros took a relay from 43 MB to 835 MB). Each
# must end in the dead-letter table.
_ZEROS = "(SELECT jsonb_agg(0) FROM generate_series(1, 10 * 1048576 / 3))"
_OBJECTS = "(SELECT jsonb_agg('{}'::jsonb) FROM generate_series(1, 10 * 1048576 / 4))"
HOSTILE: dict[str, dict[str, str]] = {
    "headers-10mib-array": {"headers": _ZEROS},
    "headers-10mib-table-of-array": {"headers": f"jsonb_build_object('a', {_ZEROS})"},
    "headers-10mib-table-of-objects": {"headers": f"jsonb_build_object('a', {_OBJECTS})"},
    "headers-10mib-keys": {"headers": "(SELECT jsonb_object_agg('k' || n, 0)"
                                      " FROM generate_series(1, 10 * 1048576 / 12) AS n)"},
    "headers-nested": {"headers": "(repeat('{\"a\": ', 10000) || '1' || repeat('}', 10000))::jsonb"},
    "headers-300kb-string": {"headers": "jsonb_build_object('big', repeat('x', 300000))"},
    "headers-list": {"headers": "'[1]'::jsonb"},
    "headers-long-key": {"headers": "jsonb_build_object(repeat('k', 300), 1)"},
    "headers-int-over-64-bits": {"headers": "'{\"n\": 18446744073709551616}'::jsonb"},
    "created-at-infinity": {"created_at": "'infinity'"},
    "routing-key-2mb": {"routing_key": "repeat('r', 2000000)"},
    "exchange-2mb": {"exchange": "repeat('e', 2000000)"},
    "content-type-2mb": {"content_type": "repeat('c', 2000000)"},
    "message-type-2mb": {"message_type": "repeat('t', 2000000)"},
    # Counted in row_bytes: over the limit by more than 1 MiB, moved by the claim, never fetched.
    "correlation-id-10mib": {"correlation_id": "repeat('c', 10 * 1048576)"},
    "m" * 2000: {},  # a message_id of 2,000 characters
    "to-the-ledger": {"exchange": "''", "routing_key": "'outbox.ledger'"},
    # Over the limit by less than the 1 MiB the claim lets through: fetched, then dead-lettered.
    "payload-json-over-limit": {"payload": "jsonb_build_object('pad', repeat('y', %(limit)s))"},
    "payload-bytes-over-limit": {"payload_bytes": "convert_to(repeat('z', %(limit)s + 1), 'UTF8')"},
}
# Publishable header tables just under the default frame_max (131072 bytes), in the shapes of
# the most Python objects per byte: what a relay must still decode, encode and publish.
NEAR_FRAME_MAX: dict[str, dict[str, str]] = {
    "headers-near-frame-max-nulls": {"headers": "jsonb_build_object('a', (SELECT jsonb_agg("
                                                "NULL::int) FROM generate_series(1, 130000)))"},
    "headers-near-frame-max-objects": {"headers": "jsonb_build_object('a', (SELECT jsonb_agg("
                                                  "'{}'::jsonb) FROM generate_series(1, 26000)))"},
    # The most bytes on the wire per byte of row data: 5 for "0, ".
    "headers-near-frame-max-zeros": {"headers": "jsonb_build_object('a', (SELECT jsonb_agg(0)"
                                                " FROM generate_series(1, 26000)))"},
}


def insert_row(db: psycopg.Connection[Any], message_id: str, columns: dict[str, str],
               **values: Any) -> None:
    """One row: ``columns`` (SQL expressions over %(exchange)s and ``values``) over a row's
    defaults (``message_id``, the exchange, routing key ``big``, an empty JSON payload)."""
    row = {"message_id": "%(id)s", "exchange": "%(exchange)s", "routing_key": "'big'", **columns}
    if "payload" not in row and "payload_bytes" not in row:
        row["payload"] = "'{}'::jsonb"
    db.execute(f"INSERT INTO outbox ({', '.join(row)}) VALUES ({', '.join(row.values())})",
               {"id": message_id, **values})


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


# docs/reliability.md#memory, the bound: a relay's peak resident memory exceeds its idle size
# by at most three copies of the most row data it holds (a batch and the one claimed ahead
# share OUTBOX_BATCH_MAX_BYTES, and a row alone may be as large as the claim fetches), the
# Python objects of two batches of rows, and the decoding of one header table.
ROW_OBJECTS_BYTES = 2 * 1024
DECODE_BYTES = 16 * MIB


def bound_bytes(*, batch_max_bytes: int, max_message_bytes: int, batch_size: int) -> int:
    """What a relay's peak resident memory may exceed its idle size by, with these settings."""
    fetched = max(batch_max_bytes, max_message_bytes + ROW_HEADROOM)
    return 3 * fetched + 2 * batch_size * ROW_OBJECTS_BYTES + DECODE_BYTES


def measure(*, rows: int, row_mb: float, oversized: int, oversized_mb: float, small: int,
            budget_mb: float | None = None, max_message_mb: float | None = None,
            batch_size: int | None = None, hostile: bool | Collection[str] = False,
            near_frame_max: int = 0, timeout: float = 600) -> dict[str, Any]:
    """Run the measurement; the figures as a dict (sizes in MiB).

    None for a setting: the relay's default. ``hostile``: True for every row of HOSTILE, or the
    names of some; ``near_frame_max``: rows of each shape of NEAR_FRAME_MAX.
    """
    default = RelaySettings(database_url="postgresql://relay@db/app", amqp_url="amqp://mq/")
    effective = replace(
        default,
        batch_max_bytes=default.batch_max_bytes if budget_mb is None else int(budget_mb * MIB),
        max_message_bytes=(default.max_message_bytes if max_message_mb is None
                           else int(max_message_mb * MIB)),
        batch_size=batch_size or default.batch_size)
    given = {"OUTBOX_BATCH_MAX_BYTES": str(effective.batch_max_bytes),
             "OUTBOX_MAX_MESSAGE_BYTES": str(effective.max_message_bytes),
             "OUTBOX_BATCH_SIZE": str(effective.batch_size)}
    chosen = {name: columns for name, columns in HOSTILE.items()
              if hostile is True or (not isinstance(hostile, bool) and name in hostile)}
    publishable = {f"{name}-{n}": columns for name, columns in NEAR_FRAME_MAX.items()
                   for n in range(near_frame_max)}
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
        env = launch.program_env(pg.url, rabbit.url, OUTBOX_CONFIRM_TIMEOUT="120", **given)
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
            for message_id, columns in {**chosen, **publishable}.items():
                insert_row(db, message_id, columns, exchange=EXCHANGE,
                           limit=effective.max_message_bytes)
            produced.extend(publishable)
            largest = db.execute("SELECT coalesce(max(row_bytes), 0) FROM outbox"
                                 " WHERE row_bytes <= %s",
                                 (effective.max_message_bytes + ROW_HEADROOM,)).fetchone()
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
        bound = bound_bytes(batch_max_bytes=effective.batch_max_bytes,
                            max_message_bytes=effective.max_message_bytes,
                            batch_size=effective.batch_size)
        return {
            "rows": rows, "row_mib": row_mb, "oversized_rows": oversized,
            "oversized_mib": oversized_mb, "small_events": small,
            "hostile_rows": len(chosen), "near_frame_max_rows": len(publishable),
            "batch_size": effective.batch_size,
            "batch_max_bytes_mib": round(effective.batch_max_bytes / MIB, 2),
            "max_message_bytes_mib": round(effective.max_message_bytes / MIB, 2),
            "largest_fetched_row_mib": round((largest[0] if largest else 0) / MIB, 2),
            "baseline_rss_mib": round(baseline / 1024, 1),
            "peak_rss_mib": round(peak / 1024, 1),
            "peak_above_baseline_mib": round((peak - baseline) / 1024, 1),
            "bound_above_baseline_mib": round(bound / MIB, 1),
            "seconds": round(seconds, 1), "dead_lettered": dead,
            "expected_dead_letters": oversized + len(chosen),
            "missing": len(missing), "delivered": len(delivered),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev memory", description=__doc__)
    parser.add_argument("--rows", type=int, default=6, help="rows of --row-mb (default 6)")
    parser.add_argument("--row-mb", type=float, default=4,
                        help="MiB per big row (4: OUTBOX_MAX_MESSAGE_BYTES' default)")
    parser.add_argument("--oversized", type=int, default=2,
                        help="rows over OUTBOX_MAX_MESSAGE_BYTES (2)")
    parser.add_argument("--oversized-mb", type=float, default=150, help="MiB of those (150)")
    parser.add_argument("--small", type=int, default=2000, help="small events (2000)")
    parser.add_argument("--budget-mb", type=float, default=None,
                        help="OUTBOX_BATCH_MAX_BYTES in MiB (default: the relay's)")
    parser.add_argument("--max-message-mb", type=float, default=None,
                        help="OUTBOX_MAX_MESSAGE_BYTES in MiB (default: the relay's)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="OUTBOX_BATCH_SIZE (default: the relay's)")
    parser.add_argument("--hostile", action=argparse.BooleanOptionalAction, default=True,
                        help="the hostile rows of docs/reliability.md and 10 MiB headers (on)")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="of those, only this one (repeatable): " + ", ".join(
                            name[:40] for name in HOSTILE))
    parser.add_argument("--near-frame-max", type=int, default=20, metavar="N",
                        help="N rows of each publishable header table just under frame_max (20)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    figures = measure(rows=args.rows, row_mb=args.row_mb, oversized=args.oversized,
                      oversized_mb=args.oversized_mb, small=args.small, budget_mb=args.budget_mb,
                      max_message_mb=args.max_message_mb, batch_size=args.batch_size,
                      hostile=args.only or args.hostile, near_frame_max=args.near_frame_max)
    for name, value in figures.items():
        print(f"  {name:<26}{value:>12}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    ok = figures["missing"] == 0 and figures["dead_lettered"] == figures["expected_dead_letters"]
    within = figures["peak_above_baseline_mib"] <= figures["bound_above_baseline_mib"]
    print("\npeak within the bound of docs/reliability.md#memory" if within
          else "\nOVER the bound of docs/reliability.md#memory")
    print("\nOK" if ok else "\nFAILED: rows missing or not dead-lettered")
    return 0 if ok and within else 1


if __name__ == "__main__":
    sys.exit(main())
