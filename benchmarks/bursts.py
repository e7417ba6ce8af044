"""Bursts after a quiet spell: the traffic shape that made the claim 10x slower (issue 9).

One long-lived PostgreSQL (the benchmark's own, autovacuum on at its defaults, fsync on), and
real ``outbox-relay run`` processes with default settings (plus a resolver), started once per
series and never restarted. Before each burst the outbox is empty and left idle for
``idle`` seconds (default 70: autovacuum's default naptime is 60 s, so it visits the drained
table, truncates it and resets its statistics to "empty", the state that built the bad plans);
then ``events`` rows arrive in ONE transaction and the clock runs from its COMMIT until the
sink queue holds them all. The bare-publisher ceiling is measured in each idle spell (it
touches only the broker, not the outbox), so every ratio is to a ceiling of the same run.
pg_class and the autovacuum counters are recorded before each burst: the state it met.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import psycopg

from benchmarks import ceiling, processes
from benchmarks.workload import Servers, SinkDepth, burst, purge_sink, reset, say

_TABLE_STATE = """
SELECT c.relpages, c.reltuples::bigint, s.autovacuum_count, s.autoanalyze_count,
       s.n_live_tup, s.n_dead_tup
FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.oid = 'outbox'::regclass
"""


def table_state(db_url: str) -> dict[str, int]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row: Any = conn.execute(_TABLE_STATE).fetchone()
    keys = ("relpages", "reltuples", "autovacuum_count", "autoanalyze_count", "live", "dead")
    return dict(zip(keys, (int(v) for v in row), strict=True))


def series(servers: Servers, logdir: Path, relays: int, *, bursts: int, idle: float,
           events: int, window: int) -> dict[str, Any]:
    """``bursts`` bursts against ``relays`` relay processes started once."""
    reset(servers)
    tag = f"bursts-x{relays}"
    programs = [processes.resolver(servers, logdir, f"{tag}-resolver")]
    programs += [processes.relay(servers, logdir, f"{tag}-relay{i}") for i in range(relays)]
    depth = SinkDepth(servers)
    runs: list[dict[str, Any]] = []
    try:
        for program in programs[1:]:
            program.log_field("relay_started", "instance")
        for number in range(bursts):
            quiet_until = time.monotonic() + idle
            ceiling_rate = ceiling.publish_rate(servers, events, window).rate
            purge_sink(servers)
            time.sleep(max(0.0, quiet_until - time.monotonic()))
            before = table_state(servers.db_url)
            seconds = burst(servers, depth, f"b{relays}-{number}", events)
            runs.append({"burst": number + 1, "seconds": round(seconds, 3),
                         "rate": round(events / seconds), "ceiling": round(ceiling_rate),
                         "table_before": before})
            say(f"  x{relays} burst {number + 1}/{bursts}: {events / seconds:,.0f} events/s "
                 f"(ceiling {ceiling_rate:,.0f}; pg_class before: {before['relpages']} pages, "
                 f"{before['reltuples']} tuples; autovacuum runs so far "
                 f"{before['autovacuum_count']})")
        for program in programs:
            if program.proc.poll() is not None:
                raise RuntimeError(f"{program.name} exited during the bursts: {program.log_path}")
    finally:
        depth.close()
        for program in programs:
            program.stop()
    return summarize(runs)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each burst's ratio to the run's median ceiling, and min / median / max of both."""
    median_ceiling = statistics.median(r["ceiling"] for r in runs)
    for run in runs:
        run["ratio"] = round(run["rate"] / median_ceiling, 3)
    ratios = [r["ratio"] for r in runs]
    rates = [r["rate"] for r in runs]
    return {"bursts": runs, "ceiling_median": round(median_ceiling),
            "rate": {"min": min(rates), "median": round(statistics.median(rates)),
                     "max": max(rates)},
            "ratio": {"min": min(ratios), "median": round(statistics.median(ratios), 3),
                      "max": max(ratios)}}


def run(servers: Servers, logdir: Path, *, counts: list[int], bursts: int, idle: float,
        events: int, window: int) -> dict[str, Any]:
    with psycopg.connect(servers.db_url, autocommit=True) as conn:
        server = {name: str(conn.execute(f"SHOW {name}").fetchone()[0])  # type: ignore[index]
                  for name in ("autovacuum", "autovacuum_naptime", "fsync", "server_version")}
    results: dict[str, Any] = {"events_per_burst": events, "idle_s": idle, "window": window,
                               "postgresql": server}
    for relays in counts:
        say(f"bursts with {relays} relay(s): {bursts} x {events:,} events, {idle:g} s idle "
             "before each")
        results[str(relays)] = series(servers, logdir, relays, bursts=bursts, idle=idle,
                                      events=events, window=window)
    return results
