"""What both chaos runs share (devenv/chaos.py on single servers, devenv/chaos_cluster.py on a
RabbitMQ cluster and a PostgreSQL primary/standby pair): the traffic, a steady producer and a
hostile one, and the helpers that start the programs and watch the batches in doubt.
"""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import psycopg
from psycopg.types.json import Jsonb

from devenv import launch

EXCHANGE = "chaos.events"
QUEUE = "chaos.sink"
LEDGER = "outbox.ledger"
MAX_MESSAGE_BYTES = 256 * 1024  # the relays' OUTBOX_MAX_MESSAGE_BYTES in the chaos runs

# Hostile rows: {kind: the columns a buggy or malicious producer writes}. Each can never be
# published; every one must end in the dead-letter table, whatever the faults.
HOSTILE: dict[str, dict[str, Any]] = {
    "nested_headers": {"headers": "NESTED"},
    "headers_not_object": {"headers": Jsonb(["not", "an", "object"])},
    "headers_over_frame_max": {"headers": Jsonb({"big": "x" * 200_000})},
    "header_int_too_big": {"headers": Jsonb({"n": 2**70})},
    "created_infinity": {"created_at": "infinity"},
    "created_minus_infinity": {"created_at": "-infinity"},
    "created_bc": {"created_at": "4713-01-01 00:00:00+00 BC"},
    "created_year_10000": {"created_at": "10000-01-01 00:00:00+00"},
    "created_1960": {"created_at": "1960-01-01 00:00:00+00"},
    "forged_ledger_default_exchange": {"exchange": "", "routing_key": LEDGER, "payload": "FORGED"},
    "forged_ledger_exchange": {"exchange": LEDGER, "routing_key": LEDGER, "payload": "FORGED"},
    "oversized_payload": {"payload_bytes": b"\x00" * (MAX_MESSAGE_BYTES + 1)},
    "long_routing_key": {"routing_key": "r" * 300},
}


@dataclass
class Tally:
    relay_kills: int = 0
    postgres_restarts: int = 0
    rabbitmq_restarts: int = 0
    connection_cuts: int = 0
    black_holes: int = 0
    # Relays or resolvers that exited without being killed: a bug, whatever the checker says.
    unexpected_exits: int = 0
    max_in_doubt_seconds: float = 0.0
    produced: list[str] = field(default_factory=list)
    producer_errors: int = 0
    hostile: list[str] = field(default_factory=list)  # message ids: expected in dead letter
    forged_records: int = 0  # forged records appended to the ledger stream directly

    @property
    def faults(self) -> int:
        return (self.relay_kills + self.postgres_restarts + self.rabbitmq_restarts
                + self.connection_cuts + self.black_holes)


class Producer(threading.Thread):
    """Inserts events at a steady rate; retries a failed transaction with the same ids."""

    def __init__(self, url: str, rate: float, stop: threading.Event, tally: Tally) -> None:
        super().__init__(daemon=True)
        self.url, self.rate, self.stop_event, self.tally = url, rate, stop, tally
        # Held from BEGIN until ``tally.produced`` has the committed ids: a reader holding it
        # sees the table and the tally agree (the cluster run's flow sampling).
        self.lock = threading.Lock()

    def _insert(self, conn: psycopg.Connection[Any], seq: int, count: int) -> None:
        with conn.transaction():
            conn.execute(
                "INSERT INTO outbox (message_id, exchange, routing_key, ordering_key,"
                " payload) SELECT 'c-' || n, %(ex)s, 'chaos', 'k' || (n %% 32),"
                " jsonb_build_object('key', 'k' || (n %% 32), 'seq', n,"
                " 'pad', repeat('x', 160))"
                " FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) n"
                " ON CONFLICT (message_id) DO NOTHING",
                {"ex": EXCHANGE, "lo": seq, "hi": seq + count - 1})

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        tick = 0.05
        per_tick = max(1, round(self.rate * tick))
        seq = 0
        next_at = time.monotonic()
        while not self.stop_event.is_set():
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(self.url, autocommit=True, connect_timeout=2)
                with self.lock:
                    self._insert(conn, seq, per_tick)
                    # After the commit: ids whose commit failed are retried, not counted.
                    self.tally.produced.extend(f"c-{n}" for n in range(seq, seq + per_tick))
                seq += per_tick
            except psycopg.Error:
                # Outcome unknown: retry the same ids; ON CONFLICT makes the retry idempotent.
                self.tally.producer_errors += 1
                conn = None
                time.sleep(0.2)
                continue
            next_at += tick
            time.sleep(max(0.0, next_at - time.monotonic()))


class HostileProducer(threading.Thread):
    """Inserts a hostile row of a random kind every ``gap`` seconds on average, committed or
    retried with the same message id (ON CONFLICT makes a retry after a lost commit safe).

    Forged ledger records name a batch that is in doubt right now (pg_prepared_xacts is
    readable by everyone), its real xid included. Now and then one is also appended to the
    stream directly, as another broker user would: the resolver must reject it.
    """

    def __init__(self, url: str, amqp_url: str, gap: float, stop: threading.Event, tally: Tally,
                 rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.url, self.amqp_url, self.gap = url, amqp_url, gap
        self.stop_event, self.tally, self.rng = stop, tally, rng

    def _in_doubt(self, conn: psycopg.Connection[Any] | None) -> tuple[str, int]:
        row = None
        if conn is not None:
            row = conn.execute("SELECT gid, transaction::text::bigint FROM pg_prepared_xacts"
                               " ORDER BY random() LIMIT 1").fetchone()
        return (str(row[0]), int(row[1])) if row else ("outbox:00000001:1", 1)

    def _forged(self, conn: psycopg.Connection[Any] | None) -> dict[str, Any]:
        gid, xid = self._in_doubt(conn)
        return {"type": "batch", "v": 1, "gid": gid, "xid": xid, "database": "outbox",
                "count": 1, "relay": "forged", "mac": f"{self.rng.getrandbits(256):064x}"}

    def _forge_in_stream(self, conn: psycopg.Connection[Any] | None) -> None:
        try:
            amqp = pika.BlockingConnection(pika.URLParameters(self.amqp_url))
            try:
                amqp.channel().basic_publish("", LEDGER, json.dumps(self._forged(conn)).encode())
            finally:
                amqp.close()
            self.tally.forged_records += 1
        except (pika.exceptions.AMQPError, OSError):
            pass

    def _columns(self, kind: str, n: int, conn: psycopg.Connection[Any] | None) -> dict[str, Any]:
        columns: dict[str, Any] = {"message_id": f"h-{n}-{kind}", "exchange": EXCHANGE,
                                   "routing_key": "chaos", "payload": Jsonb({"hostile": kind})}
        columns.update(HOSTILE[kind])
        if columns.get("headers") == "NESTED":
            columns["headers"] = '{"a":' * 5000 + "1" + "}" * 5000
        if columns.get("payload") == "FORGED":
            columns["payload"] = Jsonb(self._forged(conn))
        if "payload_bytes" in columns:
            columns["payload"] = None
        return columns

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        n = 0
        pending: dict[str, Any] | None = None
        deadline = float("inf")
        while time.monotonic() < deadline:
            if self.stop_event.wait(self.rng.uniform(0, 2 * self.gap)):
                # Stopped: only a row whose insert may have failed is still written (for 30 s),
                # so every hostile row in the table is one the checker expects.
                if pending is None:
                    break
                deadline = min(deadline, time.monotonic() + 30)
                time.sleep(0.2)
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(self.url, autocommit=True, connect_timeout=2)
                if pending is None and self.rng.random() < 0.2:
                    self._forge_in_stream(conn)
                    continue
                if pending is None:
                    n += 1
                    pending = self._columns(self.rng.choice(sorted(HOSTILE)), n, conn)
                names = list(pending)
                casts = {"headers": "::jsonb", "created_at": "::timestamptz"}
                values = ", ".join(f"%({name})s{casts.get(name, '')}" for name in names)
                conn.execute(f"INSERT INTO outbox ({', '.join(names)}) VALUES ({values})"
                             " ON CONFLICT (message_id) DO NOTHING", pending)
            except psycopg.Error:
                self.tally.producer_errors += 1
                conn = None
                continue
            self.tally.hostile.append(pending["message_id"])
            pending = None
        if conn is not None:
            conn.close()


def spawn(name: str, module: str, env: dict[str, str], logdir: Path) -> subprocess.Popen[bytes]:
    return launch.launch(module, env, logdir / f"{name}.log", append=True)  # respawns append


def scalar(url: str, query: str) -> float:
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
            row = conn.execute(query).fetchone()
            return float(row[0]) if row and row[0] is not None else 0.0
    except psycopg.Error:
        return -1.0


def watch_in_doubt(url: str, watching: threading.Event, tally: Tally) -> None:
    """Sample the age of the oldest prepared transaction, faults and drain included."""
    query = "SELECT extract(epoch FROM now() - min(prepared)) FROM pg_prepared_xacts"
    while watching.is_set():
        tally.max_in_doubt_seconds = max(tally.max_in_doubt_seconds, scalar(url, query))
        time.sleep(0.25)
