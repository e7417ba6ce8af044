"""A total-queue checker (after Jepsen's): insert known events, drain the broker, compare.

Every event carries ``{"key": ordering key, "seq": n}`` in its payload so the checker can tell
lost, unexpected and duplicated deliveries apart and find order violations per key.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pika
import psycopg
from psycopg import sql

from outbox_relay.rules import ORDERING_KEY_HEADER, POSITION_HEADER
from outbox_relay.tables import Tables


@dataclass
class Delivery:
    message_id: str
    key: str | None
    seq: int | None


@dataclass
class Report:
    produced: int
    delivered: int
    lost: list[str]
    unexpected: list[str]
    duplicated: dict[str, int]  # message id -> copies beyond the first
    order_violations: dict[str, int]  # ordering key -> deliveries out of insert order
    left_in_outbox: int
    dead_lettered: int
    in_doubt: int
    extra: dict[str, Any] = field(default_factory=dict)
    # The message ids in the dead-letter table (one entry per dead letter).
    dead_letter_ids: list[str] = field(default_factory=list)

    @property
    def duplicates(self) -> int:
        return sum(self.duplicated.values())

    def dead_letter_missing(self, expected: set[str]) -> set[str]:
        """Rows expected in the dead-letter table (hostile rows) that are not there: lost."""
        return expected - set(self.dead_letter_ids)

    def ok(self, *, max_duplicates: int = 0, dead_letter_expected: int | set[str] = 0) -> bool:
        """``dead_letter_expected``: how many dead letters, or exactly which message ids (each
        once: a hostile row is published never and dead-lettered once). Per-key order of first
        deliveries is part of it."""
        if isinstance(dead_letter_expected, set):
            dead_ok = sorted(self.dead_letter_ids) == sorted(dead_letter_expected)
        else:
            dead_ok = self.dead_lettered == dead_letter_expected
        return (
            not self.lost
            and not self.unexpected
            and self.duplicates <= max_duplicates
            and self.left_in_outbox == 0
            and dead_ok
            and self.in_doubt == 0
            and not self.order_violations
        )

    def summary(self) -> str:
        return (
            f"produced={self.produced} delivered={self.delivered} lost={len(self.lost)} "
            f"unexpected={len(self.unexpected)} duplicates={self.duplicates} "
            f"order_violations={sum(self.order_violations.values())} "
            f"left_in_outbox={self.left_in_outbox} dead_lettered={self.dead_lettered} "
            f"in_doubt={self.in_doubt}"
        )


def insert_events(
    conn: psycopg.Connection[Any],
    table: str,
    count: int,
    *,
    exchange: str,
    routing_key: str,
    prefix: str = "ev",
    keys: int = 16,
    start: int = 0,
    per_transaction: int = 1000,
) -> list[str]:
    """Insert ``count`` events the way a producer would (plain INSERTs); returns their ids."""
    outbox = Tables(table).outbox
    query = sql.SQL(
        "INSERT INTO {} (message_id, exchange, routing_key, ordering_key, payload) "
        "SELECT %(prefix)s || '-' || n, %(exchange)s, %(routing_key)s, 'k' || (n %% %(keys)s), "
        "jsonb_build_object('key', 'k' || (n %% %(keys)s), 'seq', n, 'pad', repeat('x', 160)) "
        "FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS n"
    ).format(outbox)
    for lo in range(start, start + count, per_transaction):
        hi = min(lo + per_transaction, start + count) - 1
        with conn.transaction():
            conn.execute(query, {"prefix": prefix, "exchange": exchange,
                                 "routing_key": routing_key, "keys": keys, "lo": lo, "hi": hi})
    return [f"{prefix}-{n}" for n in range(start, start + count)]


def drain(
    amqp_url: str,
    queue: str,
    *,
    expected: set[str] | None = None,
    idle_timeout: float = 2.0,
    total_timeout: float = 120.0,
) -> list[Delivery]:
    """Consume ``queue`` until every id of ``expected`` arrived or, without ``expected``, until
    it is empty: idle for ``idle_timeout`` is not empty (a classic queue reading 200,000
    persistent messages back from disk paused longer than half a second)."""
    deliveries: list[Delivery] = []
    seen: set[str] = set()
    # A cluster's comma-separated URLs: the first node that answers.
    conn = pika.BlockingConnection([pika.URLParameters(u) for u in amqp_url.split(",")])
    try:
        channel = conn.channel()
        channel.basic_qos(prefetch_count=2000)
        deadline = time.monotonic() + total_timeout
        for method, props, body in channel.consume(queue, inactivity_timeout=idle_timeout):
            if method is None:
                done = (expected <= seen if expected is not None
                        else channel.queue_declare(queue, passive=True).method.message_count == 0)
                if done or time.monotonic() > deadline:
                    break
                continue
            channel.basic_ack(method.delivery_tag)
            deliveries.append(delivery(props, body))
            seen.add(props.message_id)
            if time.monotonic() > deadline:
                break
        channel.cancel()
    finally:
        conn.close()
    return deliveries


def delivery(props: Any, body: bytes) -> Delivery:
    """A consumed message: its ordering key and position, from the headers the relay sets on
    a keyed row (x-ordering-key, x-outbox-id: the row's id, the order it must arrive in), or
    else from the payload's "key" and "seq"."""
    headers = props.headers or {}
    key, position = headers.get(ORDERING_KEY_HEADER), headers.get(POSITION_HEADER)
    if key is None or position is None:
        try:
            data = json.loads(body)
        except ValueError:
            data = {}
        key = data.get("key") if isinstance(data, dict) else None
        position = data.get("seq") if isinstance(data, dict) else None
    return Delivery(props.message_id, key, position)


def late_first_copies(deliveries: list[Delivery]) -> list[tuple[int, str]]:
    """Order per key: the position in ``deliveries`` and the key of each first copy that came
    after a newer event of its key (first copies only, in delivery order, must have increasing
    seq)."""
    late: list[tuple[int, str]] = []
    last: dict[str, int] = {}
    first_seen: set[str] = set()
    for i, d in enumerate(deliveries):
        if d.message_id in first_seen or d.key is None or d.seq is None:
            continue
        first_seen.add(d.message_id)
        if d.seq < last.get(d.key, -1):
            late.append((i, d.key))
        last[d.key] = max(last.get(d.key, -1), d.seq)
    return late


def check(
    produced: list[str],
    deliveries: list[Delivery],
    *,
    conn: psycopg.Connection[Any] | None = None,
    table: str = "outbox",
    gid_prefix: str = "outbox",
) -> Report:
    """Compare what was produced with what was delivered, and count what is left over."""
    produced_set = set(produced)
    copies = Counter(d.message_id for d in deliveries)
    delivered_set = set(copies)
    violations = Counter(key for _i, key in late_first_copies(deliveries))
    left = dead = in_doubt = 0
    dead_ids: list[str] = []
    if conn is not None:
        tables = Tables(table)
        left = _count(conn, sql.SQL("SELECT count(*) FROM {}").format(tables.outbox))
        dead_ids = [row[0] for row in conn.execute(
            sql.SQL("SELECT message_id FROM {}").format(tables.dead_letter)).fetchall()]
        dead = len(dead_ids)
        in_doubt = _count(conn, sql.SQL(
            "SELECT count(*) FROM pg_prepared_xacts WHERE starts_with(gid, {})"
        ).format(sql.Literal(gid_prefix + ":")))
    return Report(
        produced=len(produced),
        delivered=len(deliveries),
        lost=sorted(produced_set - delivered_set),
        unexpected=sorted(delivered_set - produced_set),
        duplicated={m: n - 1 for m, n in copies.items() if n > 1},
        order_violations=dict(violations),
        left_in_outbox=left,
        dead_lettered=dead,
        in_doubt=in_doubt,
        dead_letter_ids=dead_ids,
    )


def _count(conn: psycopg.Connection[Any], query: sql.Composed) -> int:
    row = conn.execute(query).fetchone()
    return int(row[0]) if row else 0
