"""The broker-side ledger: a RabbitMQ stream with one record per fully confirmed batch.

The relay appends ``{"type": "batch", "gid": ...}`` after every confirm of a batch is in and
before COMMIT PREPARED. The resolver reads it from a timestamp; since a stream consumer is
never told it has reached the end, the resolver first appends a marker of its own and reads
until that marker comes back: every record published before the marker has then been seen.
"""

from __future__ import annotations

import json
import logging
import uuid
from datetime import datetime
from typing import Any

import pika.exceptions

from relay import amqp
from relay.errors import TransientError

log = logging.getLogger(__name__)

PREFETCH = 1000
ACK_EVERY = 200


def batch_record(gid: str, count: int, relay: str) -> bytes:
    return json.dumps({"type": "batch", "gid": gid, "count": count, "relay": relay}).encode()


def marker_record(marker: str) -> bytes:
    return json.dumps({"type": "marker", "marker": marker}).encode()


def new_marker() -> str:
    return f"marker-{uuid.uuid4()}"


def read_until_marker(conn: Any, stream: str, since: datetime, marker: str,
                      timeout: float) -> dict[str, int]:
    """{gid: message count} of every batch record from ``since`` up to ``marker`` (which must be
    published).

    Raises TransientError if the marker does not come back within ``timeout`` seconds: without
    it, "not in the ledger" would be a guess.
    """
    gids: dict[str, int] = {}
    seen = False
    unacked = 0
    blocking = conn.channel()
    blocking.basic_qos(prefetch_count=PREFETCH)  # a stream consumer must set a prefetch
    # The asynchronous core, not BlockingChannel: on cancel, pika rejects what the blocking
    # layer still holds, and a stream answers basic.reject by closing the whole connection.
    channel = blocking._impl

    def on_message(ch: Any, method: Any, _props: Any, body: bytes) -> None:
        nonlocal seen, unacked
        if seen:
            return  # records after our marker: not needed; released when the channel closes
        try:
            record = json.loads(body)
        except ValueError:
            record = {}
        if isinstance(record, dict):
            if record.get("type") == "batch" and isinstance(record.get("gid"), str):
                count = record.get("count")
                gids[record["gid"]] = count if isinstance(count, int) else 0
            elif record.get("type") == "marker" and record.get("marker") == marker:
                seen = True
        unacked += 1
        if seen or unacked >= ACK_EVERY:
            ch.basic_ack(method.delivery_tag, multiple=True)  # credit for the next records
            unacked = 0

    tag = channel.basic_consume(stream, on_message, arguments={"x-stream-offset": since})
    try:
        amqp.pump(conn, lambda: seen or not channel.is_open, timeout)
        if not channel.is_open:
            raise TransientError("ledger read: the channel was closed by the broker")
        if not seen:
            raise TransientError(
                f"ledger marker did not come back within {timeout:g} s; cannot decide")
    finally:
        _stop_reading(blocking, tag)
    return gids


def _stop_reading(blocking: Any, tag: str) -> None:
    """Close the reading channel without rejecting anything.

    pika rejects (requeues) what arrives for a consumer it is cancelling, and a stream answers
    basic.reject by closing the whole connection (540 NOT_IMPLEMENTED), which is likely while
    relays keep appending after our marker. pika skips the reject for a consumer it takes for a
    no-ack one: the records stay unacked and the channel's close releases them. Should the
    broker close the connection all the same, the read is complete once the marker was seen:
    the caller finds its connection closed and opens a new one.
    """
    channel = blocking._impl
    try:
        if channel.is_open:
            channel._consumers_with_noack.add(tag)
            blocking.close()
    except (pika.exceptions.AMQPError, *amqp.CONNECTION_ERRORS) as exc:
        log.debug("ledger consumer ended by the broker: %r", exc,
                  extra={"action": "ledger_read_closed"})
