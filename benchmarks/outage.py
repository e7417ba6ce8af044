"""A backlog after a broker outage (issue 9): how fast the relays drain it.

Two real relays and a resolver (default settings) relay a steady ``rate`` events/s; after
``warm`` seconds RabbitMQ is stopped for ``outage`` seconds (the outbox fills while the relays'
sessions, and any plan they cache, were made on a small table), then started again while the
producer goes on. Sampled every 0.1 s: the sink's depth (no consumer: the depth is what the
broker has confirmed); every 0.5 s the outbox backlog (a count of the whole table: at 0.1 s it
took a share of the 2 cores it measures; between counts a sample carries the last one, so the
drain's end is seen up to 0.5 s late, never early). Reported: the seconds from the broker's
start to the first publish (the relays' reconnection backoff, up to
OUTBOX_RECONNECT_MAX_DELAY), to the backlog drained (back under one second of load), the drain
rate from the first publish to drained and second by second, each against the ceiling measured
before and after in the run.
"""

from __future__ import annotations

import json
import statistics
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg

from benchmarks import ceiling, processes
from benchmarks.steady import Producer
from benchmarks.workload import (
    Servers,
    SinkDepth,
    check_exactly_once,
    purge_sink,
    reset,
    say,
)
from devenv.servers import RabbitServer
from outbox_relay.relay.settings import BATCH_SIZE

RELAYS = 2
DEFAULT_BATCH = BATCH_SIZE.parse(BATCH_SIZE.default or "")  # the relays run at defaults
SAMPLE = 0.1
COUNT_EVERY = 5  # samples between two counts of the backlog


def _backlog(conn: psycopg.Connection[Any]) -> int:
    row: Any = conn.execute("SELECT count(*) FROM outbox").fetchone()
    return int(row[0])


def run(servers: Servers, rabbit: RabbitServer, logdir: Path, *, rate: int, warm: float,
        outage: float, tail: float, events: int, window: int) -> dict[str, Any]:
    reset(servers)
    ceilings = [ceiling.publish_rate(servers, events, window).rate]
    purge_sink(servers)
    programs = [processes.resolver(servers, logdir, "outage-resolver")]
    programs += [processes.relay(servers, logdir, f"outage-relay{i}") for i in range(RELAYS)]
    samples: list[tuple[float, int, int]] = []  # (seconds since the broker's start, depth, backlog)
    try:
        for program in programs[1:]:
            program.log_field("relay_started", "instance")
        producer = Producer(servers, "outage", rate, warm + outage + tail)
        time.sleep(warm)
        say(f"outage: RabbitMQ stopped for {outage:g} s at {rate} events/s")
        rabbit.stop()
        time.sleep(outage)
        with psycopg.connect(servers.db_url, autocommit=True) as conn:
            backlog_at_stop_end = _backlog(conn)
            rabbit.start()
            started, started_wall = time.monotonic(), time.time()
            say(f"outage: RabbitMQ started again; backlog {backlog_at_stop_end:,} rows")
            depth = SinkDepth(servers)
            try:
                drained_at = None
                backlog = backlog_at_stop_end
                while drained_at is None or time.monotonic() < drained_at + 5:
                    now = time.monotonic() - started
                    if len(samples) % COUNT_EVERY == 0:
                        backlog = _backlog(conn)
                    samples.append((round(now, 2), depth(), backlog))
                    if drained_at is None and backlog <= rate and samples[-1][1] > samples[0][1]:
                        drained_at = time.monotonic()
                    if now > 600:
                        raise RuntimeError("the backlog was not drained within 600 s")
                    time.sleep(SAMPLE)
                produced = producer.result()
                depth.wait_for(produced.count, 120)
            finally:
                depth.close()
    finally:
        for program in programs:
            program.stop()
    # Stopping the broker under the relays' batches in flight may leave some of their messages
    # in the queue unconfirmed: those batches go out again (a server crash: at most one batch
    # per relay is duplicated, docs/protocol.md).
    report = check_exactly_once(servers, [f"outage-{n}" for n in range(produced.count)],
                                "outage run", max_duplicates=RELAYS * DEFAULT_BATCH)
    ceilings.append(ceiling.publish_rate(servers, events, window).rate)
    purge_sink(servers)
    return {**summarize(samples, backlog_at_stop_end, ceilings, rate, outage, produced.count),
            "relays_reconnected_after_start_s": [
                _reconnected(program, started_wall) for program in programs[1:]],
            "duplicates": report.duplicates}


def _reconnected(program: processes.Program, since: float) -> float | None:
    """Seconds from ``since`` (wall clock) to the relay's log line saying RabbitMQ is back."""
    for line in program.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("action") == "reconnected" and entry.get("server") == "rabbitmq":
                return round(datetime.fromisoformat(entry["time"]).timestamp() - since, 2)
    return None


def summarize(samples: list[tuple[float, int, int]], backlog: int, ceilings: list[float],
              rate: int, outage: float, produced: int) -> dict[str, Any]:
    base = samples[0][1]
    first = next(s for s in samples if s[1] > base)
    drained = next(s for s in samples if s[0] >= first[0] and s[2] <= rate)
    published = drained[1] - first[1]
    seconds = max(drained[0] - first[0], SAMPLE)
    mean_ceiling = statistics.mean(ceilings)
    per_second = []  # publish rate in each whole second from the first publish to drained
    for k in range(int(seconds)):
        lo = next(s for s in samples if s[0] >= first[0] + k)
        hi = next(s for s in samples if s[0] >= first[0] + k + 1)
        per_second.append(round((hi[1] - lo[1]) / (hi[0] - lo[0])))
    drain_rate = published / seconds
    return {
        "offered_events_per_s": rate, "outage_s": outage, "relays": RELAYS,
        "produced": produced, "backlog_at_outage_end": backlog,
        "backlog_at_restart": samples[0][2],
        "first_publish_after_start_s": first[0], "drained_after_start_s": drained[0],
        "drain_seconds": round(seconds, 2), "drain_rate": round(drain_rate),
        "ceilings": [round(c) for c in ceilings], "ceiling_mean": round(mean_ceiling),
        "drain_ratio": round(drain_rate / mean_ceiling, 3),
        "per_second_rates": per_second,
        "per_second_ratios": [round(r / mean_ceiling, 3) for r in per_second],
        "samples": samples,
    }
