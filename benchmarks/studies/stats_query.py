"""What the relays' table-wide lag and backlog query costs:
``python -m benchmarks.studies.stats_query``.

Every relay runs the store's ``stats`` query (``count(*)``, the oldest due time and the rows
never due, over the whole outbox) once every ``OUTBOX_STATS_INTERVAL`` (5 s), for
``outbox_relay_backlog_events`` and ``outbox_relay_lag_seconds``. Its cost grows with the
backlog, and N relays run it N times. This starts a PostgreSQL of its own, fills an outbox to
each backlog size, and measures:

- one query, warm cache: median and worst of ``--repeat`` runs, and the plan PostgreSQL picks;
- N relays' queries arriving at the same moment (N sessions, one query each, started together):
  the slowest of them, for each N of ``--relays``;
- what N relays cost on average: N / interval queries a second, times one query's median time,
  as a share of one CPU core.

With ``--instructions`` it counts instead what one query costs PostgreSQL per row, in
instructions (its backend under callgrind, serial plans, ``--backlog`` rows, the query run 3
times less once): the same figure whatever else the machine does. Needs valgrind; minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from devenv.servers import PostgresServer
from outbox_relay.postgres import stats_params
from outbox_relay.runtime.options import STATS_INTERVAL
from outbox_relay.schema import migrate
from outbox_relay.tables import Tables

TABLE = "outbox"


def fill(conn: psycopg.Connection[Any], rows: int) -> None:
    """Top the outbox up to ``rows`` rows of the demo's shape (about 250 bytes each)."""
    outbox = Tables(TABLE).outbox
    have = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(outbox)).fetchone()
    missing = rows - int(have[0] if have else 0)
    step = 200_000
    for lo in range(0, missing, step):
        n = min(step, missing - lo)
        conn.execute(sql.SQL(
            "INSERT INTO {} (exchange, routing_key, ordering_key, payload) "
            "SELECT 'bench', 'event.created', 'k' || (n %% 16), "
            "jsonb_build_object('seq', n, 'pad', repeat('x', 160)) "
            "FROM generate_series(1, %(n)s) AS n").format(outbox), {"n": n})
    conn.execute(sql.SQL("VACUUM ANALYZE {}").format(outbox))


def full_pass() -> sql.Composed:
    """The stats query of a full pass (``after`` = 0: the whole table), the one this study
    measures (its aggregate; stats_lowest's walks, after it, stop at the first rows they
    want); the passes in between walk only the rows above their floor."""
    text = Tables(TABLE).query("stats").as_string(None)
    for name, value in stats_params(0).items():
        text = text.replace(f"%({name})s", str(value))
    return sql.Composed([sql.SQL(text)])


def one_query(url: str, query: sql.Composed) -> float:
    with psycopg.connect(url, autocommit=True) as conn:
        started = time.perf_counter()
        conn.execute(query).fetchone()
        return time.perf_counter() - started


def together(url: str, query: sql.Composed, n: int) -> float:
    """N sessions each run the query once, released at the same moment: the slowest's time."""
    conns = [psycopg.connect(url, autocommit=True) for _ in range(n)]
    for conn in conns:  # a relay's session is warm: its catalog caches are loaded
        conn.execute(query).fetchone()
    barrier = threading.Barrier(n)
    times: list[float] = []
    lock = threading.Lock()

    def run(conn: psycopg.Connection[Any]) -> None:
        barrier.wait()
        started = time.perf_counter()
        conn.execute(query).fetchone()
        elapsed = time.perf_counter() - started
        with lock:
            times.append(elapsed)

    threads = [threading.Thread(target=run, args=(c,)) for c in conns]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for c in conns:
            c.close()
    return max(times)


def measure(url: str, backlogs: list[int], relays: list[int], repeat: int,
            interval: float) -> list[dict[str, Any]]:
    query = full_pass()
    results = []
    with psycopg.connect(url, autocommit=True) as conn:
        for backlog in backlogs:
            fill(conn, backlog)
            plan = [str(row[0]) for row in conn.execute(
                sql.SQL("EXPLAIN ") + query).fetchall()]
            with psycopg.connect(url, autocommit=True) as session:
                session.execute(query).fetchone()  # warm the cache
                runs = []
                for _ in range(repeat):
                    started = time.perf_counter()
                    session.execute(query).fetchone()
                    runs.append(time.perf_counter() - started)
            median = statistics.median(runs)
            result: dict[str, Any] = {
                "backlog": backlog, "median_ms": round(median * 1000, 2),
                "max_ms": round(max(runs) * 1000, 2),
                "plan": " / ".join(line.strip().split("  (")[0] for line in plan
                                   if "Scan" in line or "Aggregate" in line),
                "together_max_ms": {}, "core_share": {},
            }
            for n in relays:
                result["together_max_ms"][n] = round(together(url, query, n) * 1000, 2)
                result["core_share"][n] = round(n / interval * median, 4)
            results.append(result)
            _print(result, interval)
    return results


def instructions(backlog: int, runs: int = 3) -> float:
    """Instructions per row of one stats query: a session that runs it 1 + ``runs`` times, less
    one that runs it once (its planning and catalog reads), over ``runs`` x ``backlog`` rows."""
    from benchmarks.studies.callgrind import backend_total, callgrind_server, stop_server

    query = full_pass()
    server = callgrind_server(extra_conf={"autovacuum": "off",
                                          "max_parallel_workers_per_gather": "0"})
    try:
        server.start(timeout=300)
        migrate(server.url, TABLE, timeout=120)
        with psycopg.connect(server.url, autocommit=True) as conn:
            fill(conn, backlog)

        def session(times: int) -> int:
            with psycopg.connect(server.url, autocommit=True) as conn:
                pid = conn.info.backend_pid
                for _ in range(times):
                    conn.execute(query).fetchone()
            return backend_total(server, pid)

        once = session(1)
        return (session(1 + runs) - once) / (runs * backlog)
    finally:
        stop_server(server)


def _print(result: dict[str, Any], interval: float) -> None:
    print(f"backlog {result['backlog']:>9,}: one query {result['median_ms']:8.2f} ms median, "
          f"{result['max_ms']:8.2f} ms worst ({result['plan']})")
    for n, slowest in result["together_max_ms"].items():
        print(f"    {n:>3} relays at once: slowest {slowest:8.2f} ms; every {interval:g} s on "
              f"average {100 * result['core_share'][n]:6.2f}% of a core")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.stats_query",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backlog", type=int, nargs="+", default=[0, 10_000, 100_000, 1_000_000],
                        help="outbox sizes to measure, ascending (default: 0 10000 100000 1000000)")
    parser.add_argument("--relays", type=int, nargs="+", default=[1, 4, 16],
                        help="numbers of relays whose queries arrive together (default: 1 4 16)")
    parser.add_argument("--repeat", type=int, default=20, help="queries per backlog (default 20)")
    parser.add_argument("--interval", type=float, default=float(STATS_INTERVAL.default or 5),
                        help="OUTBOX_STATS_INTERVAL to compute the average cost with")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--instructions", action="store_true",
                        help="count PostgreSQL's instructions per row instead (callgrind)")
    args = parser.parse_args(argv)
    if args.instructions:
        for backlog in sorted(args.backlog):
            if backlog:
                print(f"backlog {backlog:>9,}: {instructions(backlog):,.0f} instructions a row",
                      flush=True)
        return 0
    with ExitStack() as stack:
        print("starting PostgreSQL", flush=True)
        pg = stack.enter_context(PostgresServer(max_prepared_transactions=4))
        migrate(pg.url, TABLE)
        results = measure(pg.url, sorted(args.backlog), args.relays, args.repeat, args.interval)
    if args.out:
        args.out.write_text(json.dumps({"interval": args.interval, "results": results}, indent=2)
                            + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
