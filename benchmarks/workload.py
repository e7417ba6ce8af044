"""What every benchmark publishes and where: the events, the sink queue, the exactly-once check.

Events are the total-queue checker's (``{"key", "pad", "seq"}`` JSON, about 250 bytes as
published), inserted with plain INSERTs into the ``outbox`` table, published by the relay to a
topic exchange bound to one durable classic queue, the sink.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pika
import psycopg

from benchmarks.cpu import CpuMeter
from devenv import checker

EXCHANGE = "bench.events"
QUEUE = "bench.sink"
ROUTING_KEY = "bench"
TABLE = "outbox"
# The payload's JSON text is pad + about 40 bytes: 250 bytes, like the ceiling's body below.
PAD = 210
CEILING_BODY = b'{"key": "k1", "pad": "' + b"x" * PAD + b'", "seq": 12345}'


def _none() -> list[int]:
    return []


@dataclass(frozen=True)
class Servers:
    db_url: str
    amqp_url: str
    # The servers' processes, for CPU accounting (unknown for servers we did not start).
    postgres_pids: Callable[[], list[int]] = _none
    rabbitmq_pids: Callable[[], list[int]] = _none

    def cpu_meter(self) -> CpuMeter:
        return CpuMeter({"postgresql": self.postgres_pids, "rabbitmq": self.rabbitmq_pids})


def declare_sink(amqp_url: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = conn.channel()
        channel.exchange_declare(EXCHANGE, exchange_type="topic", durable=True)
        channel.queue_declare(QUEUE, durable=True)
        channel.queue_bind(QUEUE, EXCHANGE, routing_key="#")
    finally:
        conn.close()


def purge_sink(amqp_url: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        conn.channel().queue_purge(QUEUE)
    finally:
        conn.close()


def reset(servers: Servers) -> None:
    """An empty outbox, no prepared transaction left, an empty sink: every run starts equal."""
    with psycopg.connect(servers.db_url, autocommit=True) as conn:
        for (gid,) in conn.execute("SELECT gid FROM pg_prepared_xacts").fetchall():
            conn.execute(psycopg.sql.SQL("ROLLBACK PREPARED {}").format(psycopg.sql.Literal(gid)))
        conn.execute("TRUNCATE outbox, outbox_dead_letter")
        conn.execute("VACUUM ANALYZE outbox")
    purge_sink(servers.amqp_url)


def prefill(db_url: str, count: int, prefix: str) -> list[str]:
    """Insert ``count`` events (10,000 a transaction); returns their message ids."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        produced = checker.insert_events(conn, TABLE, count, exchange=EXCHANGE,
                                         routing_key=ROUTING_KEY, prefix=prefix,
                                         per_transaction=10_000, pad=PAD)
        conn.execute("ANALYZE outbox")
    return produced


class DeliveryError(RuntimeError):
    """A run delivered something other than every event exactly once: its figure is void."""


def check_exactly_once(servers: Servers, produced: list[str], what: str) -> checker.Report:
    """Drain the sink and compare with ``produced``: nothing lost, no copy, nothing left."""
    deliveries = checker.drain(servers.amqp_url, QUEUE, expected=set(produced), idle_timeout=0.5)
    with psycopg.connect(servers.db_url, autocommit=True) as conn:
        report = checker.check(produced, deliveries, conn=conn, table=TABLE)
    if not report.ok():
        raise DeliveryError(f"{what} delivered wrongly: {report.summary()}")
    return report


def outbox_rows(db_url: str) -> int:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row: Any = conn.execute("SELECT count(*) FROM outbox").fetchone()
        return int(row[0])
