"""Instructions per event, counted by callgrind: the work itself, the same count whatever else
the machine does. On a shared 2-core machine a rate moves by a third from one minute to the
next, and a change worth a few per cent shows only here.

    python -m benchmarks.studies.instructions [--rows N] [--batch B] [--keys K] [--shuffled-keys]
                                              [--shapes none,keys,...] [--out JSON]

- build: ``outbox_relay.relay.messages.to_message`` over N claimed rows of each shape (no key; K keys; no
  key, but two headers as large as a keyed message's written in the headers column, under the
  stand-in names of benchmarks.workload.KEY_HEADER_STAND_INS: a row may not set the relay's
  own; no key, and a producer's trace context, traceparent and tracestate, as the headers; no
  key, and an AMQP type and correlation id), in
  one Python process under callgrind, minus the same process building the rows only;
- claim: the relay's claim statement (sql/queries.sql), batches of B out of N rows, on a
  PostgreSQL of its own (C locale, as the benchmark's) started under callgrind: the claim
  session's backend only (the claim prepared and run by its generic plan, as the relay's),
  minus a session that runs the claim once on the empty table (its parsing, planning and
  catalog reads). Plain COMMIT after each claim: PREPARE is not what is counted.

Needs valgrind (Debian's package). Minutes: everything runs about 50 times slower under it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from benchmarks.studies.callgrind import backend_total, callgrind_server, stop_server
from benchmarks.workload import KEY_HEADER_STAND_INS, KEY_SQL, say, write_results
from devenv.servers import PostgresServer
from outbox_relay.model import OutboxRow
from outbox_relay.prepared import PreparedStatement
from outbox_relay.relay.messages import to_message
from outbox_relay.relay.store import CLAIM_STATEMENT, claim_session
from outbox_relay.schema import migrate
from outbox_relay.tables import Tables

SHAPES = ("none", "keys", "headers", "trace", "ids")
CLAIM_PARAMS = {"max_bytes": 16 << 20, "max_message_bytes": 128 << 20,
                "max_row_bytes": (128 << 20) + 65536, "one_row_at_least": True,
                "after": 0, "floor": 0, "held": Jsonb({})}
_COLLECTED = re.compile(r"Collected : (\d+)")


def _random_id(n: int, bits: int) -> int:
    """A trace or span id as a tracer makes them (random-looking bits, not a count), the same
    from run to run."""
    return (n * 0x9E3779B97F4A7C15F39CC0605CEDC835 + 1) % (1 << bits) or 1


def _row(n: int, shape: str, keys: int) -> OutboxRow:
    """A claimed row as the claim fetches it, about the benchmark's size."""
    key = f"k{n % keys}" if shape == "keys" else None
    key_name, position_name = KEY_HEADER_STAND_INS
    headers = (json.dumps({key_name: f"k{n % keys}", position_name: n}) if shape == "headers"
               else json.dumps({"traceparent": f"00-{_random_id(n, 128):032x}-"
                                               f"{_random_id(n, 64):016x}-01",
                                "tracestate": "vendor=opaque-value"}) if shape == "trace"
               else "{}")
    return OutboxRow(id=n, message_id=f"bench-{n}", exchange="bench.events",
                     routing_key="bench.0", ordering_key=key,
                     body=b'{"key": "k1", "pad": "' + b"x" * 210 + b'", "seq": 12345}',
                     is_json=True, headers=headers, content_type=None,
                     created_epoch=1_764_000_000.5, created_at="2025-11-24 16:00:00.5+00",
                     attempts=0, message_type="bench.created.v1" if shape == "ids" else None,
                     correlation_id=f"req-{_random_id(n, 64):016x}" if shape == "ids" else None)


def _build_child(shape: str, rows: int, keys: int, build: bool) -> None:
    built = [_row(1_000_000 + n, shape, keys) for n in range(rows)]
    # A relay sets its connection's user as user_id on every message (the benchmark's: guest).
    to_message(built[0], max_bytes=1 << 20, user_id="guest")  # imports and first-call work
    for row in built if build else ():
        to_message(row, max_bytes=1 << 20, user_id="guest")


def _callgrind_python(args: list[str]) -> int:
    # One hash seed: dicts and sets then do the same work from run to run.
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
         "-m", "benchmarks.studies.instructions", *args], capture_output=True, text=True,
        check=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    found = _COLLECTED.search(out.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count from callgrind:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def build(rows: int, keys: int, shapes: tuple[str, ...] = SHAPES) -> dict[str, int]:
    """Instructions per row of to_message, by shape (two Python processes under callgrind
    each: most of the run's minutes)."""
    per_row = {}
    for shape in shapes:
        args = ["--child-build", shape, "--rows", str(rows), "--keys", str(keys)]
        total = _callgrind_python(args)
        rows_only = _callgrind_python([*args, "--rows-only"])
        per_row[shape] = round((total - rows_only) / rows)
        say(f"build, {shape}: {per_row[shape]:,} instructions a row")
    return per_row


def _fill(url: str, tables: Tables, rows: int, keys: int, shuffled: bool = False) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {}").format(tables.outbox))
        conn.execute(sql.SQL(
            "INSERT INTO {} (message_id, exchange, routing_key, ordering_key, payload) "
            "SELECT 'bench-' || n, 'bench.events', 'bench.0', " + KEY_SQL + ", "
            "jsonb_build_object('key', 'k1', 'seq', n, 'pad', repeat('x', 210)) "
            "FROM generate_series(1, %(rows)s) AS n").format(tables.outbox),
            {"keys": keys, "rows": rows, "shuffled": shuffled})
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(tables.outbox))


def _claim_session(server: PostgresServer, tables: Tables, batch: int, claims: int) -> int:
    """Instructions of one claim session's backend that claims ``claims`` batches."""
    claim = PreparedStatement(CLAIM_STATEMENT, tables.query("claim"))
    with psycopg.connect(server.url, autocommit=True) as conn:
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
        claim.prepare(claim_session(conn))  # as the relay's claim session: one generic plan
        for _ in range(claims):
            conn.execute("BEGIN")
            got = conn.execute(claim.execute_query({"limit": batch, **CLAIM_PARAMS})).fetchall()
            conn.execute("COMMIT")
            if claims > 1 and len(got) != batch:
                raise RuntimeError(f"a claim returned {len(got)} rows, not {batch}")
    return backend_total(server, pid)


def claim(rows: int, batch: int, keys: int, shuffled: bool = False) -> dict[str, int]:
    """Instructions per claimed row of the claim, without keys and with ``keys`` keys (at
    random distances when ``shuffled``, as benchmarks.workload's --shuffled-keys)."""
    server = callgrind_server(extra_conf={"autovacuum": "off"})
    try:
        server.start(timeout=180)
        tables = Tables("outbox")
        migrate(server.url, tables.name, timeout=60)
        _fill(server.url, tables, 0, 0)
        base = _claim_session(server, tables, batch, 1)
        per_row = {}
        for shape, count in (("none", 0), ("keys", keys)):
            _fill(server.url, tables, rows, count, shuffled)
            total = _claim_session(server, tables, batch, rows // batch)
            per_row[shape] = round((total - base) / (rows // batch * batch))
            say(f"claim, {shape}: {per_row[shape]:,} instructions a row")
        return per_row
    finally:
        stop_server(server)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.instructions",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=20_000, help="rows claimed, and built")
    parser.add_argument("--batch", type=int, default=2_000, help="rows a claim asks for")
    parser.add_argument("--keys", type=int, default=10_000, help="distinct ordering keys")
    parser.add_argument("--shuffled-keys", action="store_true",
                        help="row n's key is hash(n) mod K, at random distances (else n mod K)")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"row shapes whose build is counted, comma-separated ({', '.join(SHAPES)})")
    parser.add_argument("--out", type=Path, default=Path("results/instructions.json"))
    parser.add_argument("--child-build", choices=SHAPES, help=argparse.SUPPRESS)
    parser.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_build:
        _build_child(args.child_build, args.rows, args.keys, build=not args.rows_only)
        return 0
    if args.rows < args.batch or args.keys < 1:
        parser.error("--rows must be at least --batch, and --keys at least 1")
    shapes = tuple(args.shapes.split(","))
    if not shapes or not set(shapes) <= set(SHAPES):
        parser.error(f"--shapes: a comma-separated list of {', '.join(SHAPES)}")
    results: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.studies.instructions",
                             *(argv or sys.argv[1:])]),
        "rows": args.rows, "batch": args.batch, "keys": args.keys,
        "shuffled_keys": args.shuffled_keys,
        "build": build(min(args.rows, 2_000), args.keys, shapes),
        "claim": claim(args.rows, args.batch, args.keys, args.shuffled_keys)}
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
