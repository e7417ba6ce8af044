"""What one small claim costs, as at a steady low load: the relay's round trip and PostgreSQL's
work by statement.

    python -m benchmarks.studies.claim_cost [--claims N] [--rows R] [--out JSON]

On a PostgreSQL of its own (fsync on, as the benchmark's): ``N`` times, a producer inserts
``R`` rows, then one relay's store claims them and commits (a batch of a steady load, without
the PREPARE and the broker). Timed: the claim and its COMMIT, from the relay's side (median and
p90, microseconds). With pg_stat_statements (Debian's PostgreSQL has it; the run goes on
without it), each statement's calls and its plan and execution milliseconds a call.

The claims run back to back, so the table's dead tuples are those of a steady load between two
autovacuums. It reads the store as ``relay.store`` from the current directory, so it measures
an older commit too: run it by its path from that commit's tree
(``cd <worktree> && python <this tree>/benchmarks/studies/claim_cost.py``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, ".")  # the current tree's store, when run by path from another one
# By name, at run time: the tree's own store and migrate, whatever its layout.
OutboxStore: Any = importlib.import_module("relay.store").OutboxStore
try:
    migrate: Any = importlib.import_module("outbox_relay.schema").migrate
except ImportError:  # a tree from before the one installed package
    migrate = importlib.import_module("relay.migrate").migrate
servers: Any = importlib.import_module("devenv.servers")

_INSERT = ("INSERT INTO outbox (message_id, exchange, routing_key, payload) "
           "SELECT gen_random_uuid(), 'e', 'k', '{\"n\": 1}'::jsonb FROM generate_series(1, %s)")
_STATEMENTS = """
SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 70), calls,
       total_plan_time / calls, total_exec_time / calls
FROM pg_stat_statements WHERE calls > 0 AND query NOT LIKE 'INSERT INTO outbox%%'
ORDER BY (total_plan_time + total_exec_time) DESC LIMIT 10
"""


def measure(url: str, claims: int, rows: int) -> dict[str, Any]:
    store = OutboxStore(url, "outbox")
    store.connect(lock_class=7, instance=0xC057)
    producer = psycopg.connect(url, autocommit=True)
    tracked = True
    try:
        producer.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        producer.execute("SELECT pg_stat_statements_reset()")
    except psycopg.Error:
        tracked = False
    micros: list[float] = []
    try:
        for _ in range(claims):
            producer.execute(_INSERT, (rows,))
            started = time.perf_counter()
            claimed = store.claim(2000, 1 << 30)
            store.claim_conn.execute("COMMIT")
            micros.append((time.perf_counter() - started) * 1e6)
            if len(claimed) != rows:
                raise RuntimeError(f"claimed {len(claimed)} of {rows} rows")
        statements = [
            {"query": q, "calls": calls, "plan_ms": round(plan, 3), "exec_ms": round(ex, 3)}
            for q, calls, plan, ex in producer.execute(_STATEMENTS)] if tracked else []
    finally:
        store.close()
        producer.close()
    micros.sort()
    return {"claims": claims, "rows_a_claim": rows,
            "claim_commit_us_median": round(statistics.median(micros)),
            "claim_commit_us_p90": round(micros[int(0.9 * len(micros))]),
            "statements": statements}


def run(args: argparse.Namespace, conf: dict[str, str]) -> dict[str, Any]:
    with servers.PostgresServer(max_prepared_transactions=4, extra_conf=conf) as pg:
        migrate(pg.url, "outbox")
        return measure(pg.url, args.claims, args.rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", type=int, default=3000, help="claims to time")
    parser.add_argument("--rows", type=int, default=20, help="rows inserted and claimed each")
    parser.add_argument("--out", type=Path, help="write the result as JSON")
    args = parser.parse_args(argv)
    tracking = {"shared_preload_libraries": "pg_stat_statements",
                "pg_stat_statements.track_planning": "on"}
    try:
        result = run(args, {"fsync": "on", **tracking})
    except servers.ServerError:  # no pg_stat_statements in this installation: timings only
        result = run(args, {"fsync": "on"})
    print(f"claim + COMMIT of {args.rows} rows, {args.claims} times: median "
          f"{result['claim_commit_us_median']} us, p90 {result['claim_commit_us_p90']} us")
    for s in result["statements"]:
        print(f"  {s['calls']:6d} calls  plan {s['plan_ms']:.3f} ms  exec {s['exec_ms']:.3f} ms"
              f"  {s['query']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
