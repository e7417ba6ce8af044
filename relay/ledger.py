"""The broker-side ledger: a RabbitMQ stream with one record per fully confirmed batch.

The relay appends a batch record after every confirm of a batch is in and before COMMIT
PREPARED. The resolver reads it from a timestamp; since a stream consumer is never told it has
reached the end, the resolver first appends a marker of its own and reads until that marker
comes back: every record published before the marker has then been seen.

**Trust.** Anyone who may write to the stream's exchange (or, with older relays, to the default
exchange) can append to it, so a record is evidence only if a relay wrote it. Every record
carries an HMAC-SHA256 of its fields under the ledger key, a random secret kept in PostgreSQL
(``<table>_ledger_key``) that only the relays' role can read: the role that can finish prepared
transactions anyway. A batch record also names the prepared transaction's xid and database, and
the resolver checks both against ``pg_prepared_xacts``: a genuine record of an earlier
transaction that had the same gid proves nothing about this one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pika.exceptions

from relay import amqp, pika_private
from relay.errors import TransientError

log = logging.getLogger(__name__)

PREFETCH = 1000
ACK_EVERY = 200
# A read reports progress (and is allowed to go on) after this many records.
PROGRESS_EVERY = 1000
VERSION = 1


def _mac(key: bytes, fields: list[Any]) -> str:
    """HMAC-SHA256 over the canonical JSON of ``fields`` (a list: no key order to agree on)."""
    text = json.dumps(["outbox-ledger", VERSION, *fields], separators=(",", ":"), ensure_ascii=True)
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def batch_record(key: bytes, *, gid: str, xid: int, database: str, count: int,
                 relay: str) -> bytes:
    """The signed record of a batch whose messages the broker confirmed (step 4)."""
    mac = _mac(key, ["batch", gid, xid, database, count, relay])
    return json.dumps({"type": "batch", "v": VERSION, "gid": gid, "xid": xid,
                       "database": database, "count": count, "relay": relay,
                       "mac": mac}).encode()


def marker_record(key: bytes, marker: str) -> bytes:
    return json.dumps({"type": "marker", "v": VERSION, "marker": marker,
                       "mac": _mac(key, ["marker", marker])}).encode()


def new_marker() -> str:
    return f"marker-{uuid.uuid4()}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _authentic_batch(key: bytes, record: dict[str, Any]) -> bool:
    fields = [record.get(name) for name in ("gid", "xid", "database", "count", "relay")]
    gid, xid, database, count, relay = fields
    mac = record.get("mac")
    if not (isinstance(gid, str) and _is_int(xid) and isinstance(database, str)
            and _is_int(count) and isinstance(relay, str) and isinstance(mac, str)):
        return False
    return hmac.compare_digest(_mac(key, ["batch", *fields]), mac)


def _authentic_marker(key: bytes, record: dict[str, Any]) -> bool:
    mac = record.get("mac")
    return isinstance(mac, str) and hmac.compare_digest(
        _mac(key, ["marker", record.get("marker")]), mac)


@dataclass(frozen=True)
class Expected:
    """What a record must say to decide an in-doubt batch: its prepared transaction's xid and
    database, as ``pg_prepared_xacts`` has them."""

    xid: int
    database: str


@dataclass(frozen=True)
class Rejected:
    """A record that names an in-doubt batch but proves nothing about it."""

    gid: str
    reason: str  # "unauthenticated" or "other_transaction"
    offset: Any  # the record's stream offset (or None), to report each record once
    detail: str


def check_batch(record: dict[str, Any], *, key: bytes, candidates: Mapping[str, Expected],
                offset: Any) -> int | Rejected | None:
    """What a ledger record says about the candidates: the message count of the batch it proves
    committed, a Rejected when it names a candidate but proves nothing, None when it names none."""
    gid = record.get("gid")
    if record.get("type") != "batch" or not isinstance(gid, str) or gid not in candidates:
        return None  # not about a batch we are deciding: not worth a signature check
    if not _authentic_batch(key, record):
        return Rejected(gid, "unauthenticated", offset, "no valid signature of the ledger key")
    expected = candidates[gid]
    if record["xid"] != expected.xid or record["database"] != expected.database:
        return Rejected(
            gid, "other_transaction", offset,
            f"written for xid {record['xid']} in database {record['database']!r}, the "
            f"prepared transaction is xid {expected.xid} in {expected.database!r}")
    count: int = record["count"]
    return count


def read_until_marker(
    conn: Any,
    stream: str,
    since: datetime,
    marker: str,
    *,
    key: bytes,
    candidates: Mapping[str, Expected],
    idle_timeout: float,
    on_progress: Callable[[], None] = lambda: None,
    on_rejected: Callable[[Rejected], None] = lambda _r: None,
) -> dict[str, int]:
    """{gid: message count} of the authentic records of ``candidates`` from ``since`` up to
    ``marker`` (which must be published, signed with ``key``).

    Only the candidates' gids are kept, whatever the ledger holds. The read fails (a
    TransientError) when no record at all arrived for ``idle_timeout`` seconds before the
    marker, however long it has been going on: without the marker, "not in the ledger" would be
    a guess. A record of a candidate that fails the checks is reported to ``on_rejected`` and
    ignored.
    """
    found: dict[str, int] = {}
    seen = False
    received = 0
    unacked = 0
    blocking = conn.channel()
    blocking.basic_qos(prefetch_count=PREFETCH)  # a stream consumer must set a prefetch
    # The asynchronous core, not BlockingChannel: on cancel, pika rejects what the blocking
    # layer still holds, and a stream answers basic.reject by closing the whole connection.
    channel = pika_private.async_channel(blocking)

    def examine(record: dict[str, Any], props: Any) -> None:
        nonlocal seen
        if record.get("type") == "marker" and record.get("marker") == marker:
            if _authentic_marker(key, record):
                seen = True
            else:
                on_rejected(Rejected(marker, "unauthenticated", _offset(props),
                                     "a marker with our id and no valid signature"))
            return
        verdict = check_batch(record, key=key, candidates=candidates, offset=_offset(props))
        if isinstance(verdict, Rejected):
            on_rejected(verdict)
        elif verdict is not None:
            found[record["gid"]] = verdict

    def on_message(ch: Any, method: Any, props: Any, body: bytes) -> None:
        nonlocal received, unacked
        if seen:
            return  # records after our marker: not needed; released when the channel closes
        received += 1
        try:
            record = json.loads(body)
        except (ValueError, RecursionError):
            record = None
        if isinstance(record, dict):
            examine(record, props)
        unacked += 1
        if seen or unacked >= ACK_EVERY:
            ch.basic_ack(method.delivery_tag, multiple=True)  # credit for the next records
            unacked = 0

    tag = channel.basic_consume(stream, on_message, arguments={"x-stream-offset": since})
    try:
        while True:
            before = received
            amqp.pump(conn, lambda before=before: (  # type: ignore[misc]
                seen or not channel.is_open or received - before >= PROGRESS_EVERY), idle_timeout)
            if seen:
                break
            if not channel.is_open:
                raise TransientError("ledger read: the channel was closed by the broker")
            if received == before:
                raise TransientError(
                    f"ledger read made no progress for {idle_timeout:g} s ({received} records "
                    "read, our marker not among them); cannot decide")
            on_progress()
    finally:
        _stop_reading(blocking, tag)
    return found


def _offset(props: Any) -> Any:
    headers = getattr(props, "headers", None) or {}
    return headers.get("x-stream-offset")


def _stop_reading(blocking: Any, tag: str) -> None:
    """Close the reading channel without rejecting anything.

    pika rejects (requeues) what arrives for a consumer it is cancelling, and a stream answers
    basic.reject by closing the whole connection (540 NOT_IMPLEMENTED), which is likely while
    relays keep appending after our marker. pika skips the reject for a consumer it takes for a
    no-ack one: the records stay unacked and the channel's close releases them. Should the
    broker close the connection all the same, the read is complete once the marker was seen:
    the caller finds its connection closed and opens a new one.
    """
    channel = pika_private.async_channel(blocking)
    try:
        if channel.is_open:
            pika_private.mark_no_ack(channel, tag)
            blocking.close()
    except (pika.exceptions.AMQPError, *amqp.CONNECTION_ERRORS) as exc:
        log.debug("ledger consumer ended by the broker: %r", exc,
                  extra={"action": "ledger_read_closed"})
