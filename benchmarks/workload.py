"""What every benchmark publishes and where: the events, the sink queue, the exactly-once check.

Events are the total-queue checker's (``{"key", "pad", "seq"}`` JSON, about 250 bytes as
published), inserted with plain INSERTs into the ``outbox`` table, published by the relay to a
topic exchange bound to one durable classic queue, the sink (or to several, by routing key).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import psycopg
from psycopg import sql

from benchmarks.cpu import CpuMeter
from devenv import checker

EXCHANGE = "bench.events"
QUEUE = "bench.sink"
ROUTING_PREFIX = "bench."  # event n is routed with "bench.<n % sink queues>"
TABLE = "outbox"
ROOT = Path(__file__).resolve().parent.parent
# The payload's JSON text is pad + about 40 bytes: 250 bytes, like the ceiling's body below.
PAD = 210
CEILING_BODY = b'{"key": "k1", "pad": "' + b"x" * PAD + b'", "seq": 12345}'

# Event n has ordering key 'k<n % keys>', or none when keys is 0 (the default workload: order is
# the --keys scenario's subject, measured against this). n % keys puts a key's events exactly
# `keys` ids apart, so a batch never shares a key with the next `keys` ids; with shuffled_keys the
# key is 'k<hash(n) % keys>' instead, a key's events at random distances, as an aggregate's are.
# With key_headers, a row without a key carries two headers as large as those the relay adds
# to a keyed row's message (x-ordering-key, x-outbox-id): what those headers cost apart from
# the order. A row may not set the relay's own (outbox_relay.rules.RELAY_HEADERS: dead-lettered),
# so they go under stand-in names of the same lengths, KEY_HEADER_STAND_INS, with the same
# values: the broker gets a header table of the same size and shape.
# KEY_SQL is that key as SQL over n (with %(keys)s and %(shuffled)s), also for the benchmarks
# that insert rows of their own (benchmarks/studies/instructions.py).
KEY_SQL = ("CASE WHEN %(keys)s > 0 THEN 'k' || ("
           "CASE WHEN %(shuffled)s THEN hashint8(n)::bigint + 2147483648 ELSE n END "
           "%% greatest(%(keys)s, 1)) END")

KEY_HEADER_STAND_INS = ("x-grouping-key", "x-outbox-no")

_INSERT = sql.SQL(
    "INSERT INTO {} (message_id, exchange, routing_key, ordering_key, payload, headers) "
    "SELECT %(prefix)s || '-' || n, %(exchange)s, %(routing)s || (n %% %(queues)s), key, "
    "jsonb_build_object('key', key, 'seq', n, 'pad', repeat('x', %(pad)s)), "
    "CASE WHEN %(key_headers)s THEN jsonb_build_object("
    "%(key_stand_in)s::text, 'k' || (n %% 10000), %(position_stand_in)s::text, n) "
    "ELSE '{{}}' END "
    "FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS n, "
    "LATERAL (SELECT " + KEY_SQL + " AS key) AS k"
).format(sql.Identifier(TABLE))


def _none() -> list[int]:
    return []


@dataclass(frozen=True)
class Servers:
    db_url: str
    amqp_url: str
    # The servers' processes, for CPU accounting (unknown for servers we did not start).
    postgres_pids: Callable[[], list[int]] = _none
    rabbitmq_pids: Callable[[], list[int]] = _none
    # One queue takes every event; more spread them by routing key (--sink-queues).
    sink_queues: int = 1
    keys: int = 0  # distinct ordering keys of the events (0: none)
    key_headers: bool = False  # rows without a key carry stand-ins of a keyed message's headers
    shuffled_keys: bool = False  # keys by a hash of the event's number, not its number mod keys
    # The sink is purged at every depth poll: a queue its consumers keep near empty, as in
    # production, without a consumer's CPU on the machine (SinkDepth).
    drained_sink: bool = False

    def cpu_meter(self, **more: Callable[[], list[int]]) -> CpuMeter:
        """The servers' CPU, and ``more`` named groups of processes beside them."""
        return CpuMeter({"postgresql": self.postgres_pids, "rabbitmq": self.rabbitmq_pids, **more})


def queue_names(queues: int) -> list[str]:
    return [QUEUE] if queues == 1 else [f"{QUEUE}.{i}" for i in range(queues)]


def declare_sink(amqp_url: str, queues: int, queue_type: str = "classic") -> None:
    """The sink: ``queues`` durable queues of ``queue_type`` (classic or quorum) bound to the
    benchmark's topic exchange."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = conn.channel()
        channel.exchange_declare(EXCHANGE, exchange_type="topic", durable=True)
        for i, name in enumerate(queue_names(queues)):
            channel.queue_declare(name, durable=True, arguments={"x-queue-type": queue_type})
            channel.queue_bind(name, EXCHANGE, routing_key="#" if queues == 1 else
                               f"{ROUTING_PREFIX}{i}")
    finally:
        conn.close()


def purge_sink(servers: Servers) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(servers.amqp_url))
    try:
        channel = conn.channel()
        for name in queue_names(servers.sink_queues):
            channel.queue_purge(name)
    finally:
        conn.close()


def reset(servers: Servers) -> None:
    """An empty outbox, no prepared transaction left, an empty sink: every run starts equal."""
    with psycopg.connect(servers.db_url, autocommit=True) as conn:
        for (gid,) in conn.execute("SELECT gid FROM pg_prepared_xacts").fetchall():
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        conn.execute("TRUNCATE outbox, outbox_dead_letter")
        conn.execute("VACUUM ANALYZE outbox")
    purge_sink(servers)


def insert_events(conn: psycopg.Connection[Any], prefix: str, lo: int, hi: int,
                  queues: int, keys: int = 0, key_headers: bool = False,
                  shuffled_keys: bool = False) -> None:
    """Events ``<prefix>-<lo>`` .. ``<prefix>-<hi>``, as a producer's plain INSERT (no NOTIFY)."""
    conn.execute(_INSERT, {"prefix": prefix, "exchange": EXCHANGE, "routing": ROUTING_PREFIX,
                           "queues": queues, "pad": PAD, "lo": lo, "hi": hi, "keys": keys,
                           "key_headers": key_headers, "shuffled": shuffled_keys,
                           "key_stand_in": KEY_HEADER_STAND_INS[0],
                           "position_stand_in": KEY_HEADER_STAND_INS[1]})


def prefill(servers: Servers, count: int, prefix: str) -> list[str]:
    """Insert ``count`` events, 10,000 a transaction; returns their message ids."""
    with psycopg.connect(servers.db_url, autocommit=True) as conn:
        for lo in range(0, count, 10_000):
            insert_events(conn, prefix, lo, min(lo + 10_000, count) - 1, servers.sink_queues,
                          servers.keys, servers.key_headers, servers.shuffled_keys)
        conn.execute("ANALYZE outbox")
    return [f"{prefix}-{n}" for n in range(count)]


class DeliveryError(RuntimeError):
    """A run delivered something other than every event exactly once: its figure is void."""


def check_exactly_once(servers: Servers, produced: list[str], what: str, *,
                       max_duplicates: int = 0, drain_timeout: float = 300.0) -> checker.Report:
    """Drain the sink and compare with ``produced``: nothing lost, nothing left, no copy (or
    at most ``max_duplicates``, where a run stops a server under batches in flight)."""
    # Every message was confirmed, so it is in its queue: drain each until it is empty.
    deliveries = [delivery for name in queue_names(servers.sink_queues)
                  for delivery in checker.drain(servers.amqp_url, name, idle_timeout=0.5,
                                                total_timeout=drain_timeout)]
    with psycopg.connect(servers.db_url, autocommit=True) as conn:
        report = checker.check(produced, deliveries, conn=conn, table=TABLE)
    if not report.ok(max_duplicates=max_duplicates):
        raise DeliveryError(f"{what} delivered wrongly: {report.summary()}")
    return report


def outbox_rows(db_url: str) -> int:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row: Any = conn.execute("SELECT count(*) FROM outbox").fetchone()
        return int(row[0])


class SinkDepth:
    """Messages in the sink queue(s) now: a passive declare per queue, one round trip each.

    The scenarios that time "until the queue holds them" run without a consumer, so the depth
    is what the relays have published and the broker has confirmed. With
    ``servers.drained_sink`` each poll purges the queues instead and the depth is how many
    messages it purged so far: a queue persisting 50,000 messages nobody reads costs RabbitMQ
    more per message, and more again with headers, than one its consumers keep empty."""

    def __init__(self, servers: Servers) -> None:
        self._conn = pika.BlockingConnection(pika.URLParameters(servers.amqp_url))
        self._channel = self._conn.channel()
        self._names = queue_names(servers.sink_queues)
        self.drains = servers.drained_sink
        self.purged = 0

    def __call__(self) -> int:
        if self.drains:
            self.purged += sum(self._channel.queue_purge(name).method.message_count
                               for name in self._names)
            return self.purged
        return sum(self._channel.queue_declare(name, passive=True).method.message_count
                   for name in self._names)

    def wait_for(self, count: int, timeout: float, interval: float = 0.01) -> float:
        """Poll until the queues hold ``count`` messages; the monotonic time they did."""
        deadline = time.monotonic() + timeout
        while (depth := self()) < count:
            if time.monotonic() > deadline:
                raise DeliveryError(f"the sink holds {depth:,} of {count:,} after {timeout:g} s")
            time.sleep(interval)
        return time.monotonic()

    def close(self) -> None:
        self._conn.close()


class SinkDrainer(threading.Thread):
    """Purges the sink every 10 ms until stopped, beside a publisher that counts its own
    confirms (the ceiling's): the drained sink of ``servers.drained_sink`` for it too."""

    def __init__(self, servers: Servers) -> None:
        super().__init__(daemon=True)
        self._servers, self._stopped = servers, threading.Event()

    def run(self) -> None:
        depth = SinkDepth(self._servers)  # its connection, used by this thread alone
        try:
            while not self._stopped.wait(0.01):
                depth()
        finally:
            depth.close()

    def stop(self) -> None:
        self._stopped.set()
        self.join()


def burst(servers: Servers, depth: SinkDepth, prefix: str, events: int,
          timeout: float = 600.0, meter: CpuMeter | None = None) -> float:
    """Insert ``events`` in ONE transaction (as a producer's batch job would) and return the
    seconds from its COMMIT until the sink holds them all; every event checked exactly once.
    ``meter`` runs over those seconds only (not the insert): its ``seconds`` then hold them."""
    with psycopg.connect(servers.db_url, autocommit=True) as conn:
        # One statement: one transaction.
        insert_events(conn, prefix, 0, events - 1, servers.sink_queues, servers.keys,
                      servers.key_headers, servers.shuffled_keys)
    committed = time.monotonic()
    if meter is not None:
        meter.start()
    seconds = depth.wait_for(events, timeout) - committed
    if meter is not None:
        meter.stop()
    if depth.drains:
        # Purged messages cannot be checked one by one: the count, and nothing left behind.
        time.sleep(0.2)
        left = outbox_rows(servers.db_url)
        if depth() != events or left:
            raise DeliveryError(f"burst {prefix}: {depth.purged:,} messages for {events:,} "
                                f"events, {left:,} rows left in the outbox")
    else:
        check_exactly_once(servers, [f"{prefix}-{n}" for n in range(events)], f"burst {prefix}")
    return seconds


def say(text: str) -> None:
    """A progress line on stderr (the results go to stdout and the JSON file)."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def code_version() -> str:
    """The commit the run measured, marked dirty if the work tree had changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT,
                              check=False).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def write_results(path: Path, results: dict[str, Any]) -> None:
    """A command's results as indented JSON at ``path`` (its folder made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    say(f"wrote {path}")
