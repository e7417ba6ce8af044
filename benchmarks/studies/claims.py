"""What each claim returns at the relays' steady state, without a broker: how many of the rows
a claim asks for it takes, and what the claims cost PostgreSQL.

    python -m benchmarks.studies.claims [--rows N] [--keys K] [--shuffled-keys] [--relays R]
                                        [--callgrind] [--out JSON]

R stores (each a relay's two sessions) drain N rows of the benchmark's workload in turn, each
claiming its next batch of 2,000 while its own batch and the other relays' are prepared, as a
relay claims ahead while the broker confirms (a claim made ahead is an open transaction, not a
prepared one: the same rows are held). A claim returns fewer rows than it asks for when the
rows it may take run out within its look (three batches past the rows in flight): the others
are rows of keys whose oldest row a batch in flight holds (sql/queries.sql). Counted:
claims, rows a claim over the first three quarters (the steady part, before the outbox runs
dry), and the CPU of the claim sessions' backends. A count does not depend on the machine; the
CPU does (a ratio within one run only). With --callgrind, the PostgreSQL runs under callgrind
(about 50 times slower) and the claim sessions' backends' instructions are counted too, a row
drained (PREPARE included): the work itself, the same count whatever else the machine does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.cpu import CpuMeter
from benchmarks.studies.callgrind import backend_total, callgrind_server, stop_server
from benchmarks.workload import code_version, insert_events, say, write_results
from devenv.servers import PostgresServer
from outbox_relay.relay.store import OutboxStore
from outbox_relay.schema import migrate

BATCH = 2_000
UNLIMITED_BYTES = 1 << 40


def _fill(url: str, rows: int, keys: int, shuffled: bool) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
        for lo in range(0, rows, 10_000):
            insert_events(conn, "claims", lo, min(lo + 10_000, rows) - 1, 1, keys, False,
                          shuffled)
        conn.execute("VACUUM ANALYZE outbox")


def drain(url: str, relays: int) -> tuple[dict[str, Any], list[int]]:
    """The relays drain the outbox in turn; what their claims returned and cost, and the claim
    sessions' backend pids."""
    stores = [OutboxStore(url, "outbox") for _ in range(relays)]
    for n, store in enumerate(stores):
        store.connect(lock_class=7, instance=0x0C00 + n)
    try:
        pids = [int(store.claim_conn.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
                for store in stores]
        meter = CpuMeter({"claims": lambda: pids})
        meter.start()
        in_flight: list[str | None] = [None] * relays
        sizes: list[int] = []
        empty = 0
        progress = True
        # Until a turn with no batch in flight finds nothing: nothing holds a key, so the
        # outbox is empty.
        while progress:
            progress = False
            for n, store in enumerate(stores):
                rows = store.claim(BATCH, UNLIMITED_BYTES)
                if in_flight[n] is not None:
                    store.finish(str(in_flight[n]), commit=True)  # the batch in flight commits
                    in_flight[n] = None
                    progress = True
                if rows:
                    sizes.append(len(rows))
                    in_flight[n] = f"claims:{n}:{len(sizes)}"
                    store.prepare(str(in_flight[n]))
                    progress = True
                else:
                    empty += 1
                    store.rollback()
        steady = sizes[:max(1, len(sizes) * 3 // 4)]
        return {"claims": len(sizes), "empty_claims": empty,
                "rows_a_claim_median": statistics.median(steady),
                "rows_a_claim_mean": round(statistics.mean(steady)),
                "claim_cpu_s": round(meter.stop()["claims"], 2)}, pids
    finally:
        for store in stores:
            store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.claims",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=200_000, help="rows drained")
    parser.add_argument("--keys", type=int, default=10_000,
                        help="distinct ordering keys (0: rows without a key)")
    parser.add_argument("--shuffled-keys", action="store_true",
                        help="event n's key is hash(n) mod K, at random distances (else n mod K)")
    parser.add_argument("--relays", type=int, default=4, help="relays claiming in turn")
    parser.add_argument("--callgrind", action="store_true",
                        help="count the claim sessions' instructions a row (needs valgrind)")
    parser.add_argument("--out", type=Path, default=Path("results/claims.json"))
    args = parser.parse_args(argv)
    if args.rows < 1 or args.keys < 0 or args.relays < 1:
        parser.error("--rows and --relays must be at least 1, --keys at least 0")
    settings: dict[str, Any] = {"max_prepared_transactions": 2 * args.relays,
                                "extra_conf": {"autovacuum": "off"}}
    server = callgrind_server(**settings) if args.callgrind else PostgresServer(**settings)
    try:
        server.start(timeout=180 if args.callgrind else 60)
        migrate(server.url, "outbox", timeout=60)
        _fill(server.url, args.rows, args.keys, args.shuffled_keys)
        counted, pids = drain(server.url, args.relays)
        if args.callgrind:  # the backends wrote their counts as their sessions closed
            counted["claim_instructions_a_row"] = round(
                sum(backend_total(server, pid) for pid in pids) / args.rows)
    finally:
        stop_server(server)
    command = " ".join(["python -m benchmarks.studies.claims", *(argv or sys.argv[1:])])
    results = {"command": command, "code": code_version(), "rows": args.rows, "keys": args.keys,
               "shuffled_keys": args.shuffled_keys, "relays": args.relays, "batch": BATCH,
               **counted}
    say(f"{args.relays} relays, {args.keys:,} keys{' shuffled' if args.shuffled_keys else ''}: "
        f"{counted['claims']} claims, {counted['rows_a_claim_median']:,} rows a claim "
        f"(median), claim sessions' CPU {counted['claim_cpu_s']} s"
        + (f", {counted['claim_instructions_a_row']:,} instructions a row" if args.callgrind
           else ""))
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
