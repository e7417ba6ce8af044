"""Step 3 and 4 of the protocol: publish a batch with pipelined confirms, then the ledger record.

pika's BlockingChannel waits one round trip per confirmed publish. This publisher drives the
channel's asynchronous core instead: it writes every message of the batch (in one socket
write), then pumps the connection until each delivery tag is acked, nacked or returned, so the
whole batch is in flight at once.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import pika
import pika.exceptions
import pika.spec

from outbox_relay import pika_private, rabbitmq
from outbox_relay.errors import BatchFailed, LedgerMissing, StartupCheckError, TransientError
from outbox_relay.model import Failure, Message, PublishResult, Reason

log = logging.getLogger(__name__)

EXCHANGE_CACHE_SECONDS = 30.0
# How long a graceful close waits for the broker before dropping the socket.
CLOSE_TIMEOUT = 2.0
# pika's (and RabbitMQ's) default frame_max, until a connection negotiated its own.
DEFAULT_FRAME_MAX = 131072
# Connection.Close codes by which the broker refuses what we sent (a frame too large for
# frame_max, a malformed one), not a shutdown (320) or its own failure (541): the messages in
# flight are suspects, like those of a closed channel, and an attempt is counted for them.
REFUSED_FRAME_CODES = frozenset({501, 502, 503, 505})
# A nack names the message a queue refused: a queue with x-overflow reject-publish that is
# full, or a quorum queue around a change of leader. The nacked rows are suspects (the relay
# decides what they cost: relay/worker.py, _settle); the others of the batch are confirmed as
# usual. The channel is then replaced by a new one: RabbitMQ 3.10 nacked every message on a
# channel opened right after a quorum queue's leader died, and a new channel worked once the
# new leader was known (docs/reliability.md).
NACKED = "nacked by the broker"
# The routing key of the message that checks, on every new connection, that RabbitMQ takes the
# relay's user_id (appended to the ledger's name: the ledger's direct exchange routes only the
# name itself, so the message goes nowhere).
USER_ID_CHECK_SUFFIX = ".user-id-check"


class AmqpPublisher:
    """Publishes batches and ledger records on one connection with one confirm-mode channel."""

    def __init__(
        self,
        url: str,
        *,
        ledger_stream: str,
        ledger_max_age: str,
        confirm_timeout: float,
        connect_timeout: float,
        name: str = "outbox-relay",
        user_id: str = "",
        fault: Callable[[str], None] = lambda point: None,
    ) -> None:
        self._url = url
        self._user_id_setting = user_id  # OUTBOX_AMQP_USER_ID; empty: the connection's user
        self._user_id: str | None = None
        self._ledger_stream = ledger_stream
        self._ledger_max_age = ledger_max_age
        self._confirm_timeout = confirm_timeout
        self._connect_timeout = connect_timeout
        self.name = name
        self._fault = fault
        self._conn: Any = None
        self._channel: Any = None  # pika.channel.Channel (the async core)
        self._probe: Any = None  # BlockingChannel for passive exchange checks
        self._stopped_keys: set[str] = set()  # keys of this batch with an unsent message
        self._known_exchanges: dict[str, float] = {"": float("inf")}
        self._next_tag = 1
        self._pending: dict[int, int] = {}  # delivery tag -> row id
        self._by_message_id: dict[str, int] = {}
        self._result = PublishResult()
        self._closed_reason: Failure | None = None
        self._closed_code: int | None = None
        self._nacked = 0  # messages of the current batch the broker nacked

    # -- connection -------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return (
            self._conn is not None
            and self._conn.is_open
            and self._channel is not None
            and self._channel.is_open
        )

    def connect(self) -> None:
        self.close()
        self._conn = rabbitmq.connect(self._url, timeout=self._connect_timeout, name=self.name)
        try:
            rabbitmq.declare_ledger(self._conn.channel(), self._ledger_stream, self._ledger_max_age,
                                replicas=rabbitmq.ledger_replicas(self._url),
                                reopen=self._conn.channel)
            user_id = self._user_id_setting or pika_private.connection_user(self._conn)
            if user_id is not None:
                self._check_user_id(user_id)
            self._user_id = user_id
            self._open_channel()
        except rabbitmq.CONNECTION_ERRORS as exc:
            self.close()
            raise TransientError(f"RabbitMQ connection lost during setup: {exc!r}") from exc
        except BaseException:
            self.close()
            raise
        # The programs log "rabbitmq connected/reconnected" themselves (action connected).
        log.debug("connected to RabbitMQ", extra={"action": "amqp_connected"})

    def _open_channel(self) -> None:
        """A new confirm-mode channel on the connection, replacing the one there was."""
        old, self._channel = self._channel, None
        if old is not None and old.is_open:
            old.close()  # its close callback ignores a channel that is no longer ours
        blocking = self._conn.channel()
        channel = pika_private.async_channel(blocking)  # the async core: many confirms in flight
        selected: list[bool] = []
        channel.confirm_delivery(
            ack_nack_callback=self._on_confirm, callback=lambda _frame: selected.append(True)
        )
        channel.add_on_return_callback(self._on_return)
        channel.add_on_close_callback(self._on_channel_closed)
        self._channel = channel
        self._pump_until(lambda: bool(selected), self._connect_timeout)
        if not selected:
            raise TransientError("RabbitMQ did not enable publisher confirms in time")
        self._next_tag = 1
        self._closed_reason = None
        self._closed_code = None

    def close(self, *, handshake: bool = True) -> None:
        """Close the connection, waiting at most CLOSE_TIMEOUT for the broker's answer (none
        with ``handshake=False``, for a connection that is known not to answer)."""
        conn, self._conn, self._channel, self._probe = self._conn, None, None, None
        if conn is not None and conn.is_open:
            rabbitmq.close(conn, CLOSE_TIMEOUT if handshake else 0)

    @property
    def user_id(self) -> str | None:
        """The user_id property of the messages (to_message sets it): OUTBOX_AMQP_USER_ID, else
        the user of the connection's URL; None before the first connection, or for
        credentials without a user name. RabbitMQ refuses a user_id other than the
        connection's user, so a consumer can trust that a relay published a message that
        carries it (the inbox's per-key check does)."""
        return self._user_id

    def _check_user_id(self, user_id: str) -> None:
        """Publish a message that goes nowhere with ``user_id``: RabbitMQ closes the channel
        (406) if it is not this connection's user. Without this check every batch would fail
        on it, its rows counting attempts until they were dead-lettered."""
        channel = self._conn.channel()
        try:
            channel.confirm_delivery()
            channel.basic_publish(
                exchange=self._ledger_stream,
                routing_key=self._ledger_stream + USER_ID_CHECK_SUFFIX, body=b"",
                properties=pika.BasicProperties(user_id=user_id, delivery_mode=1))
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == 406:  # PRECONDITION_FAILED: not this connection's user
                raise StartupCheckError(
                    f"RabbitMQ refused user_id {user_id!r} on the relay's messages "
                    f"({exc.reply_text}): set OUTBOX_AMQP_USER_ID to the user RabbitMQ "
                    "authenticates the relay as") from exc
            raise TransientError(f"the user_id check failed: {exc.reply_code} "
                                 f"{exc.reply_text}") from exc
        except pika.exceptions.NackError as exc:
            raise TransientError("the user_id check was nacked by the broker") from exc
        if channel.is_open:
            channel.close()

    @property
    def frame_max(self) -> int:
        """The frame_max negotiated with the broker: a message's header frame (its properties,
        headers included) must fit in one frame, or the broker closes the whole connection."""
        conn = self._conn
        if conn is None:
            return DEFAULT_FRAME_MAX
        return pika_private.frame_max(conn, DEFAULT_FRAME_MAX)

    def idle(self, seconds: float) -> None:
        """Wait while answering heartbeats; a dead connection is noticed here, not later."""
        if self._conn is None or not self._conn.is_open:
            # A connection the broker closed has its I/O loop closed too: sleeping on it
            # raises ValueError. Drop it; the loop reconnects on its next turn.
            self.close()
            time.sleep(seconds)
            return
        try:
            self._conn.sleep(seconds)
        except rabbitmq.CONNECTION_ERRORS:
            self.close()

    # -- step 3 -------------------------------------------------------------------------------

    def missing_exchanges(self, names: set[str]) -> dict[str, Failure]:
        """Exchanges that do not exist, checked passively (a publish to one would close the channel)."""
        now = time.monotonic()
        missing: dict[str, Failure] = {}
        for name in names:
            if self._known_exchanges.get(name, 0.0) > now:
                continue
            try:
                if self._probe is None or not self._probe.is_open:
                    self._probe = self._conn.channel()
                self._probe.exchange_declare(exchange=name, passive=True)
                self._known_exchanges[name] = now + EXCHANGE_CACHE_SECONDS
            except pika.exceptions.ChannelClosedByBroker as exc:
                self._probe = None
                missing[name] = Failure(Reason.EXCHANGE_NOT_FOUND, (
                    f"exchange {name!r} not found ({exc.reply_code} {exc.reply_text})"))
            except rabbitmq.CONNECTION_ERRORS as exc:
                raise TransientError(f"RabbitMQ connection lost: {exc!r}") from exc
        return missing

    def publish_batch(self, messages: Sequence[Message],
                      while_waiting: Callable[[], None] | None = None) -> PublishResult:
        """Publish every message persistent + mandatory and wait for all their confirms.

        ``while_waiting`` runs once every message is on its way and before the wait: the
        relay claims its next batch and builds its messages there, while the broker works on
        this one.
        """
        self._result = PublishResult()
        self._pending.clear()
        self._stopped_keys = set()
        self._nacked = 0
        self._by_message_id = {m.message_id: m.row_id for m in messages}
        if not self.connected:
            # Never blame rows for a channel that was already gone: roll back, reconnect.
            self._result.transient = Failure(Reason.CONNECTION_LOST, "RabbitMQ channel not open")
            return self._result
        half = len(messages) // 2
        try:
            self._publish_all(messages[:half])
            self._flush()
            self._fault("mid_publish")
            self._publish_all(messages[half:])
            if while_waiting is not None and self._closed_reason is None:
                self._flush()  # the broker gets the batch before we turn to something else
                while_waiting()
            self._wait_for_confirms()
        except pika.exceptions.ConnectionClosedByBroker as exc:
            if exc.reply_code in REFUSED_FRAME_CODES:
                # The broker refused something we sent: one of the unconfirmed rows.
                self._closed_reason = Failure(
                    Reason.CONNECTION_CLOSED,
                    f"connection closed by the broker: {exc.reply_code} {exc.reply_text}")
                self._closed_code = exc.reply_code
            else:
                self._result.transient = _lost(f"RabbitMQ connection lost: {exc!r}")
        except rabbitmq.CONNECTION_ERRORS as exc:
            self._result.transient = _lost(f"RabbitMQ connection lost: {type(exc).__name__}")
        self._settle_unconfirmed()
        if self._nacked and self._result.transient is None and self._closed_reason is None:
            self._replace_channel()
        return self._result

    def _replace_channel(self) -> None:
        """After a nack: go on with a new channel (see NACKED), or drop the connection (the
        loop reconnects) if even that fails."""
        try:
            self._open_channel()
        except rabbitmq.CONNECTION_ERRORS as exc:
            self._no_channel(exc)
        except TransientError as exc:
            self._no_channel(exc)

    def _no_channel(self, exc: BaseException) -> None:
        log.debug("no new channel after a nack: %s", exc, extra={"action": "connection_fault"})
        self.close(handshake=False)

    def _publish_all(self, messages: Sequence[Message]) -> None:
        if self._closed_reason is not None:
            return  # the broker closed the channel; the rest stays unconfirmed
        with rabbitmq.coalesced_writes(self._conn):
            for m in messages:
                if m.ordering_key in self._stopped_keys:
                    self._result.held.add(m.row_id)  # after its key's unsent row (waves.py)
                    continue
                try:
                    self._channel.basic_publish(exchange=m.exchange, routing_key=m.routing_key,
                                                body=m.body, properties=m.properties,
                                                mandatory=True)
                except rabbitmq.CONNECTION_ERRORS:
                    raise
                except Exception as exc:
                    # pika marshals a message's frames before writing any: nothing was sent,
                    # no delivery tag used. A row whose content pika cannot encode (which
                    # outbox_relay.rules should have refused) fails alone; the relay goes on.
                    self._result.failed[m.row_id] = Failure(
                        Reason.UNENCODABLE, f"cannot be encoded: {exc!r}"[:500])
                    if m.ordering_key is not None:
                        self._stopped_keys.add(m.ordering_key)
                    continue
                self._pending[self._next_tag] = m.row_id
                self._next_tag += 1

    def _wait_for_confirms(self) -> None:
        self._pump_until(lambda: not self._pending or self._closed_reason is not None,
                         self._confirm_timeout)
        if self._pending and self._closed_reason is None:
            # A channel with confirms outstanding cannot be trusted again, nor a broker that
            # does not answer: drop the socket without waiting for a close handshake.
            self.close(handshake=False)
            self._result.transient = Failure(
                Reason.CONFIRM_TIMEOUT, f"no confirm within {self._confirm_timeout:g} s",
                in_flight_lost=True)

    def _settle_unconfirmed(self) -> None:
        """Rows still pending are suspect (channel closed by the broker) or unknown (transient)."""
        unconfirmed = set(self._by_message_id.values()) - self._result.confirmed
        unconfirmed -= self._result.failed.keys() | self._result.suspect.keys() | self._result.held
        if self._closed_reason is not None and self._result.transient is None:
            for row_id in unconfirmed:
                self._result.suspect[row_id] = self._closed_reason
        elif unconfirmed and self._result.transient is None:
            self._result.transient = Failure(Reason.CONNECTION_LOST, "unconfirmed messages")
        self._pending.clear()

    # -- step 4 -------------------------------------------------------------------------------

    def record_batch(self, gid: str, record: bytes) -> None:
        """Publish the batch's (signed) ledger record and wait for its confirm."""
        self.append_ledger(record, message_id=gid)

    def append_ledger(self, body: bytes, *, message_id: str) -> None:
        """Append one record to the ledger through its exchange; raise BatchFailed unless it is
        confirmed, LedgerMissing if the stream or its exchange no longer exists."""
        properties = pika.BasicProperties(delivery_mode=2, message_id=message_id,
                                          content_type="application/json")
        stream = self._ledger_stream
        result = self.publish_batch([Message(0, message_id, stream, stream, body, properties)])
        if not result.complete(1):
            reason = result.transient or next(iter({**result.failed, **result.suspect}.values()))
            if reason.reason is Reason.UNROUTABLE or (result.suspect and self._closed_code == 404):
                # No binding (the stream was deleted) or no exchange: nothing records batches.
                raise LedgerMissing(f"ledger stream {stream!r} is gone ({reason})")
            raise BatchFailed(f"ledger record not confirmed: {reason}")

    @property
    def connection(self) -> Any:
        """The BlockingConnection, for the resolver's ledger reads."""
        if not self.connected:
            raise TransientError("not connected to RabbitMQ")
        return self._conn

    # -- callbacks and IO -------------------------------------------------------------------

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        if method.multiple:
            # Tags are pending in publishing order: the acked ones are a prefix.
            tags = list(itertools.takewhile(lambda t: t <= method.delivery_tag, self._pending))
        else:
            tags = [method.delivery_tag] if method.delivery_tag in self._pending else []
        nacked = isinstance(method, pika.spec.Basic.Nack)
        for tag in tags:
            row_id = self._pending.pop(tag)
            if nacked:
                self._nacked += 1
                if row_id not in self._result.failed:
                    self._result.suspect[row_id] = Failure(Reason.NACKED, NACKED)
            elif row_id not in self._result.failed:
                self._result.confirmed.add(row_id)

    def _on_return(self, _channel: Any, method: Any, properties: Any, _body: bytes) -> None:
        row_id = self._by_message_id.get(properties.message_id)
        if row_id is not None:
            self._result.failed[row_id] = Failure(Reason.UNROUTABLE, (
                f"unroutable: {method.reply_code} {method.reply_text} "
                f"(exchange {method.exchange!r}, routing key {method.routing_key!r})"))

    def _on_channel_closed(self, channel: Any, reason: Exception) -> None:
        if channel is not self._channel:
            return  # a channel replaced after a nack (_replace_channel)
        self._closed_reason = Failure(Reason.CHANNEL_CLOSED,
                                      f"channel closed by the broker: {reason}")
        if isinstance(reason, pika.exceptions.ChannelClosedByBroker):
            self._closed_code = reason.reply_code
            if reason.reply_code == 404:
                self._known_exchanges = {"": float("inf")}

    def _flush(self) -> None:
        self._conn.process_data_events(time_limit=0)

    def _pump_until(self, done: Callable[[], bool], timeout: float) -> None:
        rabbitmq.pump(self._conn, done, timeout)


def _lost(detail: str) -> Failure:
    """The connection went with the batch in flight: its unconfirmed messages' fate is unknown."""
    return Failure(Reason.CONNECTION_LOST, detail, in_flight_lost=True)
