"""Queue-table bloat (issue 9): a steady load while another session holds a snapshot open.

One real relay and a resolver (default settings) relay a steady ``rate`` events/s. After
``warm`` seconds another session opens a REPEATABLE READ transaction and keeps its snapshot
for ``hold`` seconds: VACUUM cannot remove any row deleted after it, so every claimed row stays
behind as a dead tuple (and a dead index entry) in front of the due rows. Then it commits and
the run goes on for ``tail`` seconds. Per bucket (a minute by default), by commit time: the
end-to-end latency p50 / p99 / max (producer COMMIT to consumer receipt), and the claim's
walk: the fresh branch of the claim (its index scan in id order to the first due rows, with
the claim session's settings, without taking locks, so it never competes with the relay)
timed six times a bucket (every 10 s), with the dead tuples the table holds and the buffers of
the outbox every other session touched per event (the claims' work, whatever the machine's
load), read every second. The walk grows with the hold: every second, it took up to half a core
by the end of a 15-minute hold at 2,000/s, taken from the relay it measures. The table's
size (relpages, the heap's and each index's bytes, n_dead_tup) is read before the snapshot, at
its end, once the resolver has compacted the table after it (its ``compacted`` line: a plain
VACUUM, then the bounded rewrite, under the same load; how long writers waited on it is in that
line and in the minute's latency), and at the end of the run. The resolver runs at its default
settings, except for a snapshot shorter than two minutes (the suite's short form): it then
counts a hold from half the snapshot and compacts from 0.25 MiB (``resolver_settings``).
With ``delayed_row`` (``--delayed-row``), a scheduled event due in a day, without an ordering
key, is inserted just before the snapshot and stays in the outbox until the run deletes it at
its end: a row held back for long, below every row the relay claims meanwhile. With
``blocked_key`` (``--blocked-key``), a key held back instead: two events of one ordering key,
inserted just before the snapshot, the first with a routing key longer than AMQP allows (the
relay moves it to the dead-letter table as it claims it), the second waiting behind that dead
letter (per-key order) until the run deletes both at its end: a poison keyed event, as it stays
until someone requeues or discards it. With ``delayed_keys`` N (``--delayed-keys N``;
``--delayed-key`` is 1), N ordering keys each with a scheduled event due in a day and a second
event of its key due at once, waiting behind it (per-key order) until the run deletes them at
its end: a reminder per customer. Past the relay's limit of held keys (100) the claims' floor
stays below them. With ``statements`` (``--statements``), what each statement cost
PostgreSQL in every bucket (benchmarks/statements.py).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from benchmarks import processes
from benchmarks.latency import percentile
from benchmarks.statements import Sampler
from benchmarks.steady import Consumer, Producer
from benchmarks.workload import EXCHANGE, ROUTING_PREFIX, Servers, reset, say
from outbox_relay.relay import store

# The claim's fresh branch as the claim session plans it (sql/queries.sql), minus FOR UPDATE.
_WALK = """
SELECT id FROM outbox WHERE attempts <= 0 AND available_at <= now() ORDER BY id LIMIT 2000
"""
_DEAD = "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = 'outbox'::regclass"
# Buffers every session touched in the outbox and its indexes so far (hit or read): the work of
# the claims (and of the producer's inserts, the stats queries, this probe's walk, which is
# subtracted), whatever the machine's load. Backends report it at most every second or so.
_BUFFERS = """
SELECT heap_blks_hit + heap_blks_read + coalesce(idx_blks_hit, 0) + coalesce(idx_blks_read, 0)
FROM pg_statio_user_tables WHERE relid = 'outbox'::regclass
"""
# The table's size: pages, heap and index bytes, dead tuples (the statistics lag a little).
_SIZE = """
SELECT c.relpages, pg_relation_size(c.oid),
       (SELECT coalesce(jsonb_object_agg(i.indexrelid::regclass::text,
                                         pg_relation_size(i.indexrelid)), '{}'::jsonb)
        FROM pg_index AS i WHERE i.indrelid = c.oid),
       (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = c.oid)
FROM pg_class AS c WHERE c.oid = 'outbox'::regclass
"""


def table_size(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """relpages, heap bytes, each index's bytes and their sum, n_dead_tup of the outbox."""
    conn.execute("SELECT pg_stat_clear_snapshot()")  # fresh statistics on every read
    row: Any = conn.execute(_SIZE).fetchone()
    return {"relpages": row[0], "heap_bytes": row[1], "index_bytes": row[2],
            "index_bytes_total": sum(row[2].values()), "n_dead_tup": row[3]}


Probe = tuple[float, float | None, int, int]


def _probe(db_url: str, stop: threading.Event, out: list[Probe], walk_every: float) -> None:
    """Every second: (monotonic time, walk ms (every ``walk_every`` seconds, else None), dead
    tuples, buffers of the outbox touched so far by every session but this one)."""
    walked = 0
    next_walk = time.monotonic()
    with psycopg.connect(db_url, autocommit=True) as conn:
        store.claim_session(conn)
        while not stop.wait(1.0):
            started = time.monotonic()
            ms = None
            if started >= next_walk:
                next_walk = started + walk_every
                plan: Any = conn.execute("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON) "
                                         + _WALK).fetchone()
                ms = (time.monotonic() - started) * 1000
                top = plan[0][0]["Plan"]
                walked += top["Shared Hit Blocks"] + top["Shared Read Blocks"]
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row: Any = conn.execute(_DEAD).fetchone()
            touched: Any = conn.execute(_BUFFERS).fetchone()
            out.append((started, ms, int(row[0]), int(touched[0]) - walked))


# A scheduled event (--delayed-row): due in a day, no ordering key; not the producer's, so
# deleted before the delivery check.
_DELAYED = """
INSERT INTO outbox (message_id, exchange, routing_key, payload, available_at)
VALUES ('bloat-delayed', %(exchange)s, %(routing)s, '{}', now() + interval '1 day')
"""


# A key held back (--blocked-key): its first event is dead-lettered, its second waits behind it.
_BLOCKED = """
INSERT INTO outbox (message_id, exchange, routing_key, ordering_key, payload)
VALUES ('bloat-blocked-0', %(exchange)s, repeat('r', 300), 'bloat-blocked', '{}'),
       ('bloat-blocked-1', %(exchange)s, %(routing)s, 'bloat-blocked', '{}')
"""


# Scheduled keyed events (--delayed-keys N): per key, one due in a day and one due at once that
# waits behind it; key n's rows are 'bloat-delayed-key-n-0' and '-1'.
_DELAYED_KEYS = """
INSERT INTO outbox (message_id, exchange, routing_key, ordering_key, payload, available_at)
SELECT format('bloat-delayed-key-%%s-%%s', k, r), %(exchange)s, %(routing)s,
       'bloat-delayed-key-' || k, '{}', CASE r WHEN 0 THEN now() + interval '1 day' ELSE now() END
FROM generate_series(0, %(keys)s - 1) AS k, generate_series(0, 1) AS r
ORDER BY k, r
"""


def _delete_blocked_key(conn: psycopg.Connection[Any]) -> bool:
    """Delete the blocked key's two rows; True if they were where they should be: its second
    event in the outbox, its first in the dead-letter table."""
    waiting = conn.execute("DELETE FROM outbox WHERE ordering_key = 'bloat-blocked'").rowcount
    dead = conn.execute("DELETE FROM outbox_dead_letter WHERE ordering_key = 'bloat-blocked'"
                        ).rowcount
    return (waiting, dead) == (1, 1)


def run(servers: Servers, logdir: Path, *, rate: int, warm: float, hold: float, tail: float,
        bucket: float, delayed_row: bool = False, blocked_key: bool = False,
        delayed_keys: int = 0, statements: bool = False) -> dict[str, Any]:
    reset(servers)
    consumer = Consumer(servers, "bloat")
    resolver_settings = {} if hold >= 120 else {
        "OUTBOX_RESOLVER_COMPACT_AFTER_HOLD": f"{hold / 2:g}",
        "OUTBOX_RESOLVER_COMPACT_ABOVE": "0.25"}
    resolver = processes.resolver(servers, logdir, "bloat-resolver", **resolver_settings)
    programs = [resolver, processes.relay(servers, logdir, "bloat-relay")]
    probes: list[Probe] = []
    sampler: Sampler | None = None
    delayed_left = blocked_left = delayed_key_left = False
    stop = threading.Event()
    prober = threading.Thread(target=_probe, args=(servers.db_url, stop, probes,
                                                   max(1.0, bucket / 6)), daemon=True)
    try:
        programs[1].log_field("relay_started", "instance")
        time.sleep(0.5)
        producer = Producer(servers, "bloat", rate, warm + hold + tail)
        origin = time.monotonic()
        prober.start()
        if statements:
            sampler = Sampler(servers.db_url, origin, bucket)
            sampler.start()
        time.sleep(warm)
        with psycopg.connect(servers.db_url, autocommit=True) as sizer:
            sizes = {"before": table_size(sizer)}
            if delayed_row:
                sizer.execute(_DELAYED, {"exchange": EXCHANGE, "routing": f"{ROUTING_PREFIX}0"})
            if delayed_keys:
                sizer.execute(_DELAYED_KEYS, {"exchange": EXCHANGE, "keys": delayed_keys,
                                              "routing": f"{ROUTING_PREFIX}0"})
            if blocked_key:
                sizer.execute(_BLOCKED, {"exchange": EXCHANGE, "routing": f"{ROUTING_PREFIX}0"})
        with psycopg.connect(servers.db_url) as holder:
            holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT count(*) FROM outbox").fetchone()  # the snapshot is taken
            say(f"bloat: a snapshot is held open for {hold:g} s")
            time.sleep(hold)
            with psycopg.connect(servers.db_url, autocommit=True) as sizer:
                sizes["snapshot_end"] = table_size(sizer)
            holder.commit()
        say("bloat: snapshot released; waiting for the resolver to compact the table")
        compacted = resolver_compaction(resolver)
        with psycopg.connect(servers.db_url, autocommit=True) as sizer:
            sizes["after_compact"] = table_size(sizer)
        produced = producer.result()
        received = consumer.wait_for(range(produced.count), timeout=120)
        with psycopg.connect(servers.db_url, autocommit=True) as sizer:
            if delayed_row:  # still there (not due): the check below wants the outbox empty
                delayed_left = sizer.execute(
                    "DELETE FROM outbox WHERE message_id = 'bloat-delayed'").rowcount == 1
            if blocked_key:
                blocked_left = _delete_blocked_key(sizer)
            if delayed_keys:  # all still there: each key's first not due, its second behind it
                delayed_key_left = sizer.execute(
                    "DELETE FROM outbox WHERE ordering_key LIKE 'bloat-delayed-key-%'"
                ).rowcount == 2 * delayed_keys
            sizes["end"] = table_size(sizer)
    finally:
        stop.set()
        by_statement = sampler.stop() if sampler else None
        for program in programs:
            program.stop()
        final = consumer.stop()
    final.check_exactly_once(produced.count, servers.db_url, "bloat run")
    summary = summarize(list(produced.commit_at), list(received.arrived_at), probes, origin,
                        warm=warm, hold=hold, bucket=bucket, rate=rate)
    return {**summary, "table_size": sizes, "compact": compacted,
            "resolver_settings": resolver_settings,
            **({"statements_by_bucket": by_statement} if by_statement is not None else {}),
            **({"delayed_row_left_at_end": delayed_left} if delayed_row else {}),
            **({"blocked_key_left_at_end": blocked_left} if blocked_key else {}),
            **({"delayed_keys": delayed_keys, "delayed_key_left_at_end": delayed_key_left}
               if delayed_keys else {})}


def resolver_compaction(resolver: processes.Program, timeout: float = 300.0) -> dict[str, Any]:
    """The resolver's ``compacted`` line after the snapshot: when it came (seconds from the
    release, as this process saw it), how long writers could have waited on the rewrite, its
    attempts and the sizes it logged; or what it said instead."""
    released = time.monotonic()
    result: dict[str, Any] = {}
    try:
        for field in ("blocked_seconds", "attempts", "heap_bytes_before", "heap_bytes_after",
                      "index_bytes_before", "index_bytes_after"):
            result[field] = json.loads(resolver.log_field("compacted", field, timeout))
        result["indexes_rebuilt_concurrently"] = resolver.log_field(
            "compacted", "indexes_rebuilt_concurrently", timeout) == "True"
    except RuntimeError:
        say(f"bloat: no compaction within {timeout:g} s; see {resolver.log_path}")
        result["compacted"] = False
        return result
    result["compacted"] = True
    result["after_release_s"] = round(time.monotonic() - released, 2)
    say(f"bloat: the resolver compacted the table {result['after_release_s']} s after the "
        f"release; writers waited at most {result['blocked_seconds']} s")
    return result


def summarize(commit_at: list[float], arrived_at: list[float],
              probes: list[Probe], origin: float, *, warm: float,
              hold: float, bucket: float, rate: int) -> dict[str, Any]:
    buckets: dict[int, list[float]] = {}
    for seq, committed in enumerate(commit_at):
        buckets.setdefault(int((committed - origin) // bucket), []).append(
            (arrived_at[seq] - committed) * 1000)
    walks: dict[int, list[float]] = {}
    dead_end: dict[int, int] = {}  # dead tuples at the end of each bucket
    touched: dict[int, int] = {}  # buffers touched by the end of each bucket
    for at, ms, dead, buffers in probes:
        index = int((at - origin) // bucket)
        if ms is not None:
            walks.setdefault(index, []).append(ms)
        dead_end[index] = max(dead, dead_end.get(index, 0))
        touched[index] = buffers
    rows: list[dict[str, Any]] = []
    for index in sorted(buckets):
        latency = sorted(buckets[index])
        walk = sorted(walks.get(index, []))
        start = index * bucket
        rows.append({
            "from_s": start, "snapshot_held": warm <= start < warm + hold
            or start < warm + hold <= start + bucket,
            "events": len(latency), "p50_ms": round(percentile(latency, 0.5), 2),
            "p99_ms": round(percentile(latency, 0.99), 2), "max_ms": round(latency[-1], 2),
            "claim_walk_ms_median": round(statistics.median(walk), 2) if walk else None,
            "claim_walk_ms_max": round(walk[-1], 2) if walk else None,
            "dead_tuples_end": dead_end.get(index),
            "outbox_buffers_per_event": (
                round((touched[index] - touched[index - 1]) / len(latency), 1)
                if index in touched and index - 1 in touched else None),
        })
    return {"offered_events_per_s": rate, "warm_s": warm, "snapshot_held_s": hold,
            "bucket_s": bucket, "by_bucket": rows,
            "worst_p99_ms": max(r["p99_ms"] for r in rows)}


def print_table(result: dict[str, Any]) -> None:
    """p50 and p99 by bucket, then the table's size, on stderr (say) as the run ends."""
    bucket = result["bucket_s"]
    say(f"snapshot held {result['snapshot_held_s']:g} s at {result['offered_events_per_s']} "
        f"events/s; by {bucket:g} s of commit time:")
    for row in result["by_bucket"]:
        held = "held" if row["snapshot_held"] else "    "
        say(f"  {row['from_s']:7.0f} s {held}  p50 {row['p50_ms']:7.2f} ms  "
            f"p99 {row['p99_ms']:7.2f} ms  max {row['max_ms']:8.2f} ms  "
            f"dead {row['dead_tuples_end']}  buffers/event {row['outbox_buffers_per_event']}")
    for moment, size in result["table_size"].items():
        say(f"  {moment}: relpages {size['relpages']}, heap {size['heap_bytes']:,} B, "
            f"indexes {size['index_bytes_total']:,} B, n_dead_tup {size['n_dead_tup']}")
    if "compact" in result:
        say(f"  compact: {result['compact']}")
    for row in result.get("statements_by_bucket", []):
        say(f"  {row['from_s']:7.0f} s  statements {row['total_ms']:,.0f} ms; the costliest:")
        for top in row["top"][:3]:
            say(f"      {top['ms']:9,.1f} ms  {top['calls']:7,} calls  "
                f"{top['ms_per_call']:8.3f} ms/call  {top['statement'][:70]}")
