"""The resolver's side of the ledger, on one RabbitMQ connection: append a marker, read until it
comes back. pika's connection errors stop at this edge (TransientError).

The stream holds whatever any user of the vhost appends: no record may stop a read, whatever
its bytes or headers (outbox_relay/ledger.py checks the bytes; pika is told to decode any
header value, pika_private.tolerate_out_of_range_fields)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import pika
import pika.exceptions
import pika.spec

from outbox_relay import ledger, pika_private, rabbitmq
from outbox_relay.errors import TransientError

log = logging.getLogger(__name__)

# A header timestamp past the year 9999 in one ledger record made pika lose the connection of
# every read (issue 32). The resolver's process only: the relays never import this module.
pika_private.tolerate_out_of_range_fields()

PREFETCH = 1000
ACK_EVERY = 200
# A read reports progress (and is allowed to go on) after this many records.
PROGRESS_EVERY = 1000
# How long a graceful close waits for the broker before dropping the socket.
CLOSE_TIMEOUT = 2.0


class AmqpLedger:
    """The ``Ledger`` of resolver/worker.py: the ledger declared, a confirm-mode channel for the
    resolver's markers, and the stream read from a timestamp up to the marker."""

    def __init__(self, url: str, *, stream: str, max_age: str, read_timeout: float,
                 connect_timeout: float) -> None:
        self._url = url
        self._stream = stream
        self._max_age = max_age
        self._read_timeout = read_timeout
        self._connect_timeout = connect_timeout
        self._conn: Any = None  # BlockingConnection
        self._markers: _MarkerChannel | None = None

    @property
    def connected(self) -> bool:
        return (self._conn is not None and self._conn.is_open and self._markers is not None
                and self._markers.is_open)

    def connect(self) -> None:
        """Connect and declare the ledger (a name clash is a StartupCheckError)."""
        self.close()
        self._conn = rabbitmq.connect(self._url, timeout=self._connect_timeout,
                                      name="outbox-resolver")
        try:
            rabbitmq.declare_ledger(self._conn.channel(), self._stream, self._max_age,
                                    replicas=rabbitmq.ledger_replicas(self._url),
                                    reopen=self._conn.channel)
            self._markers = _MarkerChannel(self._conn, self._connect_timeout)
        except rabbitmq.CONNECTION_ERRORS as exc:
            self.close()
            raise TransientError(f"RabbitMQ connection lost during setup: {exc!r}") from exc
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        conn, self._conn, self._markers = self._conn, None, None
        if conn is not None and conn.is_open:
            rabbitmq.close(conn, CLOSE_TIMEOUT)

    def committed(self, key: bytes, since: datetime, candidates: Mapping[str, ledger.Expected], *,
                  on_progress: Callable[[], None],
                  on_rejected: Callable[[ledger.Rejected], None]) -> ledger.Found:
        """{gid: message count} of the candidates with an authentic record from ``since`` up to a
        marker appended now: everything published before this call has been read."""
        if self._conn is None or self._markers is None:
            raise TransientError("not connected to RabbitMQ")
        marker = ledger.new_marker()
        try:
            self._markers.append(self._stream, ledger.marker_record(key, marker), marker,
                                 self._read_timeout)
            return read_until_marker(
                self._conn, self._stream, since, marker, key=key, candidates=candidates,
                idle_timeout=self._read_timeout, on_progress=on_progress, on_rejected=on_rejected)
        except rabbitmq.CONNECTION_ERRORS as exc:
            raise TransientError(f"RabbitMQ connection lost reading the ledger: {exc!r}") from exc


class _MarkerChannel:
    """A confirm-mode channel that appends one record at a time to the ledger's exchange,
    persistent and mandatory, and waits for the broker's confirm."""

    def __init__(self, conn: Any, timeout: float) -> None:
        self._conn = conn
        self._channel = pika_private.async_channel(conn.channel())
        self._answer: str | None = None  # "ack" or "nack" for the record in flight
        self._returned = False
        selected: list[bool] = []
        self._channel.confirm_delivery(ack_nack_callback=self._on_confirm,
                                       callback=lambda _frame: selected.append(True))
        self._channel.add_on_return_callback(self._on_return)
        rabbitmq.pump(conn, lambda: bool(selected) or not self._channel.is_open, timeout)
        if not selected:
            raise TransientError("RabbitMQ did not enable publisher confirms in time")

    @property
    def is_open(self) -> bool:
        return bool(self._channel.is_open)

    def append(self, stream: str, body: bytes, message_id: str, timeout: float) -> None:
        """Publish ``body`` to the ledger; raise TransientError unless the broker confirms it."""
        self._answer, self._returned = None, False
        properties = pika.BasicProperties(delivery_mode=2, message_id=message_id,
                                          content_type="application/json")
        self._channel.basic_publish(exchange=stream, routing_key=stream, body=body,
                                    properties=properties, mandatory=True)
        rabbitmq.pump(self._conn, lambda: self._answer is not None or not self._channel.is_open,
                      timeout)
        if self._answer == "ack" and not self._returned:
            return
        reason = ("the channel was closed by the broker" if not self._channel.is_open
                  else f"no confirm within {timeout:g} s" if self._answer is None
                  else "nacked by the broker" if self._answer == "nack"
                  else f"unroutable: the ledger stream {stream!r} is gone")
        raise TransientError(f"ledger marker not confirmed: {reason}")

    def _on_confirm(self, frame: Any) -> None:
        self._answer = "nack" if isinstance(frame.method, pika.spec.Basic.Nack) else "ack"

    def _on_return(self, _channel: Any, _method: Any, _properties: Any, _body: bytes) -> None:
        self._returned = True  # a mandatory record with no queue bound: before its ack


def read_until_marker(
    conn: Any,
    stream: str,
    since: datetime,
    marker: str,
    *,
    key: bytes,
    candidates: Mapping[str, ledger.Expected],
    idle_timeout: float,
    on_progress: Callable[[], None] = lambda: None,
    on_rejected: Callable[[ledger.Rejected], None] = lambda _r: None,
) -> ledger.Found:
    """{gid: message count} of the authentic records of ``candidates`` from ``since`` up to
    ``marker`` (which must be published, signed with ``key``), and the offsets read.

    Only the candidates' gids are kept, whatever the ledger holds. The read fails (a
    TransientError) when no record at all arrived for ``idle_timeout`` seconds before the
    marker, however long it has been going on: without the marker, "not in the ledger" would be
    a guess. A record that cannot be read or checked, and a record of a candidate that fails
    the checks, is reported to ``on_rejected`` and ignored: no record stops the read.
    """
    found = ledger.Found()
    first: int | None = None  # the read's first stream offset
    seen = False
    received = 0
    unacked = 0
    blocking = conn.channel()
    # The asynchronous core, not BlockingChannel: on cancel, pika rejects what the blocking
    # layer still holds, and a stream answers basic.reject by closing the whole connection.
    channel = pika_private.async_channel(blocking)
    # A record of any size costs at most this much memory: pika keeps none of a bigger one.
    pika_private.bound_bodies(channel, ledger.MAX_RECORD_BYTES)
    blocking.basic_qos(prefetch_count=PREFETCH)  # a stream consumer must set a prefetch

    def examine(body: bytes, offset: int | None) -> None:
        """One record: never raises, whatever its bytes (outbox_relay/ledger.py)."""
        nonlocal seen
        record = ledger.read_record(body, offset=offset, size=(
            body.size if isinstance(body, pika_private.DroppedBody) else len(body)))
        if isinstance(record, ledger.Rejected):
            on_rejected(record)
            return
        ours = ledger.check_marker(record, key=key, marker=marker, offset=offset)
        if isinstance(ours, ledger.Rejected):
            on_rejected(ours)
            return
        if ours:
            seen = True
            if first is not None and offset is not None:
                found.span = (first, offset)
            return
        verdict = ledger.check_batch(record, key=key, candidates=candidates, offset=offset)
        if isinstance(verdict, ledger.Rejected):
            on_rejected(verdict)
        elif verdict is not None:
            found[record["gid"]] = verdict

    def on_message(ch: Any, method: Any, props: Any, body: bytes) -> None:
        nonlocal received, unacked, first
        if seen:
            return  # records after our marker: not needed; released when the channel closes
        received += 1
        offset = _offset(props)
        if first is None:
            first = offset
        examine(body, offset)
        unacked += 1
        if seen or unacked >= ACK_EVERY:
            ch.basic_ack(method.delivery_tag, multiple=True)  # credit for the next records
            unacked = 0

    tag = channel.basic_consume(stream, on_message, arguments={"x-stream-offset": since})
    try:
        while True:
            before = received
            rabbitmq.pump(conn, lambda before=before: (  # type: ignore[misc]
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


def _offset(props: Any) -> int | None:
    """The record's stream offset, which RabbitMQ sets on delivery (over any header of that name
    a publisher wrote)."""
    headers = getattr(props, "headers", None)
    offset = headers.get("x-stream-offset") if isinstance(headers, dict) else None
    return offset if isinstance(offset, int) and not isinstance(offset, bool) else None


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
    # A record of any size costs at most this much memory: pika keeps none of a bigger one.
    pika_private.bound_bodies(channel, ledger.MAX_RECORD_BYTES)
    try:
        if channel.is_open:
            pika_private.mark_no_ack(channel, tag)
            blocking.close()
    except (pika.exceptions.AMQPError, *rabbitmq.CONNECTION_ERRORS) as exc:
        log.debug("ledger consumer ended by the broker: %r", exc,
                  extra={"action": "ledger_read_closed"})
