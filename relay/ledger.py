"""The broker-side ledger: a RabbitMQ stream with one record per fully confirmed batch.

The relay appends ``{"type": "batch", "gid": ...}`` after every confirm of a batch is in and
before COMMIT PREPARED. The resolver reads it from a timestamp; since a stream consumer is
never told it has reached the end, the resolver first appends a marker of its own and reads
until that marker comes back: every record published before the marker has then been seen.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import datetime
from typing import Any

import pika.exceptions

from relay.amqp import CONNECTION_ERRORS
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
                      timeout: float) -> set[str]:
    """Gids of every batch record from ``since`` up to ``marker`` (which must be published).

    Raises TransientError if the marker does not come back within ``timeout`` seconds: without
    it, "not in the ledger" would be a guess.
    """
    gids: set[str] = set()
    state = {"seen": False, "unacked": 0}
    channel = conn.channel()
    channel.basic_qos(prefetch_count=PREFETCH)  # a stream consumer must set a prefetch

    def on_message(ch: Any, method: Any, _props: Any, body: bytes) -> None:
        try:
            record = json.loads(body)
        except ValueError:
            record = {}
        if isinstance(record, dict):
            if record.get("type") == "batch" and isinstance(record.get("gid"), str):
                gids.add(record["gid"])
            elif record.get("type") == "marker" and record.get("marker") == marker:
                state["seen"] = True
        state["unacked"] += 1
        if state["seen"] or state["unacked"] >= ACK_EVERY:
            ch.basic_ack(method.delivery_tag, multiple=True)
            state["unacked"] = 0

    tag = channel.basic_consume(stream, on_message, arguments={"x-stream-offset": since})
    deadline = time.monotonic() + timeout
    try:
        while not state["seen"]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransientError(
                    f"ledger marker did not come back within {timeout:g} s; cannot decide")
            conn.process_data_events(time_limit=min(remaining, 0.25))
    finally:
        _stop_reading(channel, tag)
    return gids


def _stop_reading(channel: Any, tag: str) -> None:
    """Cancel the stream consumer; a broker that closes the connection over it is no error.

    pika rejects (requeues) the deliveries of a consumer it is cancelling that it has not yet
    dispatched, and a stream answers basic.reject by closing the whole connection (540
    NOT_IMPLEMENTED): likely while relays keep appending. Once the marker is seen the read is
    complete all the same; the caller finds its connection closed and opens a new one.
    Without the marker, the error that ended the read is the one that propagates.
    """
    try:
        if channel.is_open:
            channel.basic_cancel(tag)
            channel.close()
    except (pika.exceptions.AMQPError, *CONNECTION_ERRORS) as exc:
        log.debug("ledger consumer ended by the broker: %r", exc,
                  extra={"action": "ledger_read_closed"})
