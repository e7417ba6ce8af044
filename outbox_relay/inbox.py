"""The consumer side: an inbox that makes a handler's effect happen once per message_id.

The relay delivers at least once: after a crash a message can arrive twice, every copy with the
same ``message_id``. The inbox records each message id in a table of the consumer's own
database in the same transaction as the handler's effect, and the message is acknowledged only
after that transaction commits:

- first copy: the id is recorded, the handler runs, both commit, then the ack;
- a later copy: the id is already there, the handler does not run, the copy is acked;
- a crash (or a lost connection) before the commit: neither the id nor the effect is stored,
  the message was not acked, the broker delivers it again, and it is applied then, once;
- a crash after the commit but before the ack: the broker delivers it again, and it is acked
  as a duplicate.

``Inbox.process`` runs that transaction on a psycopg connection; ``Inbox.record`` is the step
for a transaction the caller runs itself (SQLAlchemy, Django); ``pika_callback`` and
``aio_pika_callback`` (``handle_pika``, ``handle_aio_pika``) add the ack after the commit and
the error policy (OnError). The inbox's tables: sql/inbox.sql.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeAlias, overload

import psycopg
import psycopg.errors
from psycopg import sql
from psycopg.pq import TransactionStatus

from outbox_relay import caller, tracing
from outbox_relay import sql as sql_files
from outbox_relay.errors import ConfigError, InboxError
from outbox_relay.rules import ORDERING_KEY_HEADER, POSITION_HEADER
from outbox_relay.sql import api_queries
from outbox_relay.tables import table_name

if TYPE_CHECKING:
    from aio_pika.abc import AbstractIncomingMessage
    from sqlalchemy import Connection as SAConnection
    from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
    from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session
    from sqlalchemy.orm import Session, scoped_session

    from outbox_relay.inbox_metrics import ConsumerMetrics, InboxMetrics

    SyncTarget: TypeAlias = (psycopg.Connection[Any] | psycopg.Cursor[Any] | Session
                             | scoped_session[Any] | SAConnection | caller.DBAPICursor)
    AsyncTarget: TypeAlias = (psycopg.AsyncConnection[Any] | psycopg.AsyncCursor[Any]
                              | AsyncSession | async_scoped_session[Any] | SAAsyncConnection)

log = logging.getLogger("outbox_relay.inbox")

# Seven days, like the relay's ledger (OUTBOX_LEDGER_MAX_AGE): see "Retention" in the README.
DEFAULT_RETENTION_SECONDS = 7 * 24 * 3600.0
PRUNE_BATCH = 10_000


class Outcome(Enum):
    """What the inbox did with a message."""

    APPLIED = "applied"  # first copy: recorded, and the handler ran in the same transaction
    DUPLICATE = "duplicate"  # its message_id was already recorded: the handler did not run
    STALE = "stale"  # check_order: older than the last event applied for its key; not run
    # (only a message a relay published: see Inbox's relay_users)


class OnError(Enum):
    """What the pika/aio-pika helpers do with a message whose handler raised (its transaction
    rolled back, so nothing of it is stored)."""

    REQUEUE = "requeue"  # nack and requeue, every time: redelivered until the handler succeeds
    REQUEUE_ONCE = "requeue_once"  # requeue a first delivery; reject a redelivered one
    REJECT = "reject"  # reject without requeue: the queue's dead-letter exchange gets it, if any


@dataclass(frozen=True)
class InboxMessage:
    """A delivered message, as the inbox and the handler see it."""

    message_id: str
    body: bytes
    headers: Mapping[str, Any] = field(default_factory=dict)
    routing_key: str = ""
    exchange: str = ""
    content_type: str | None = None
    redelivered: bool = False
    # The AMQP user_id property: the user that published it, which RabbitMQ checks against
    # the publishing connection's user (a relay sets its own).
    user_id: str | None = None
    # The AMQP timestamp property, in UTC: a relay sets the outbox row's created_at (whole
    # seconds). The inbox's metrics tell an applied event's age from it.
    timestamp: datetime | None = None
    # The AMQP type and correlation_id properties: the event's own, when its producer set them
    # (enqueue's message_type and correlation_id).
    message_type: str | None = None
    correlation_id: str | None = None

    @property
    def ordering_key(self) -> str | None:
        """The event's ordering key (header x-ordering-key), set by the relay for keyed rows."""
        value = self.headers.get(ORDERING_KEY_HEADER)
        return value if isinstance(value, str) else None

    @property
    def position(self) -> int | None:
        """The event's position among the events of its key (header x-outbox-id: the outbox
        row's id)."""
        value = self.headers.get(POSITION_HEADER)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def json(self) -> Any:
        """The body parsed as JSON (the relay sends a ``payload`` row as its JSON text)."""
        return json.loads(self.body)

    @classmethod
    def from_pika(cls, method: Any, properties: Any, body: bytes) -> InboxMessage:
        """From pika's (method, properties, body); InboxError if it has no message_id."""
        return cls(message_id=_message_id(properties.message_id), body=bytes(body),
                   headers=dict(properties.headers or {}), routing_key=method.routing_key or "",
                   exchange=method.exchange or "", content_type=properties.content_type,
                   redelivered=bool(method.redelivered), user_id=properties.user_id,
                   timestamp=_timestamp(properties.timestamp), message_type=properties.type,
                   correlation_id=properties.correlation_id)

    @classmethod
    def from_aio_pika(cls, message: AbstractIncomingMessage) -> InboxMessage:
        """From an aio-pika incoming message; InboxError if it has no message_id."""
        return cls(message_id=_message_id(message.message_id), body=bytes(message.body),
                   headers=dict(message.headers or {}), routing_key=message.routing_key or "",
                   exchange=message.exchange or "", content_type=message.content_type,
                   redelivered=bool(message.redelivered), user_id=message.user_id,
                   timestamp=_timestamp(message.timestamp), message_type=message.type,
                   correlation_id=message.correlation_id)


def _timestamp(value: object) -> datetime | None:
    """An AMQP timestamp as pika (epoch seconds) or aio-pika (a datetime) gives it, in UTC; None
    when absent or not a date."""
    if isinstance(value, datetime):
        return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return datetime.fromtimestamp(value, timezone.utc)
        except (OverflowError, OSError, ValueError):
            return None
    return None


def _relay_users(users: Iterable[str] | None, check_order: bool) -> frozenset[str]:
    if users is None:
        if check_order:
            raise ConfigError(
                "check_order needs relay_users: the RabbitMQ users your relays publish as "
                "(OUTBOX_AMQP_USER_ID, by default the user of OUTBOX_AMQP_URL); the order "
                "headers of a message another user published are not trusted")
        return frozenset()
    if isinstance(users, (str, bytes)):
        raise ConfigError("relay_users must be a collection of user names, not one str")
    found = frozenset(users)
    if check_order and not found:
        raise ConfigError("relay_users is empty: check_order would trust no message")
    for user in found:
        if not isinstance(user, str) or not user:
            raise ConfigError(f"relay_users must hold non-empty str, got {user!r}")
    return found


def _message_id(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InboxError("the message has no message_id: the inbox cannot tell its copies apart")
    return value


Handler: TypeAlias = Callable[[psycopg.Connection[Any], InboxMessage], object]
AsyncHandler: TypeAlias = Callable[[psycopg.AsyncConnection[Any], InboxMessage], Awaitable[object]]


class _Tables:
    def __init__(self, table: str) -> None:
        if not isinstance(table, str):
            raise ConfigError(f"inbox table must be a str, got {type(table).__name__}")
        try:
            table_name(table)
        except ValueError as exc:
            raise ConfigError(f"inbox table {table!r} {exc}") from None
        *schema, name = table.split(".")
        self.identifiers = {
            "inbox": sql.Identifier(*schema, name),
            "inbox_keys": sql.Identifier(*schema, f"{name}_keys"),
            "processed_at_index": sql.Identifier(f"{name}_processed_at_idx"),
            "keys_applied_at_index": sql.Identifier(f"{name}_keys_applied_at_idx"),
        }

    def compose(self, template: str) -> sql.Composed:
        return sql.SQL(template).format(**self.identifiers)


def inbox_schema_sql(table: str = "inbox") -> str:
    """The inbox schema for ``table`` as plain SQL (idempotent): for psql, an Alembic
    ``op.execute`` or a Django ``migrations.RunSQL``."""
    return _Tables(table).compose(sql_files.text("inbox.sql")).as_string(None)


def _connection_lost(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    return conn.closed or conn.broken


# A transaction PostgreSQL aborted to keep concurrent ones consistent: run it again.
_RETRYABLE = (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected)


class Inbox:
    """The inbox table ``table`` (``[schema.]name``) of the consumer's database, as used by the
    consumer ``consumer``: the message ids one handler has processed.

    ``check_order``: also refuse (Outcome.STALE) an event older than the last one applied for
    its ordering key, as told by the headers x-ordering-key and x-outbox-id that the relay sets
    on rows with an ordering_key. A message without them is applied as usual.
    ``relay_users``: with ``check_order`` (required then), the RabbitMQ users the relays
    publish as (their OUTBOX_AMQP_USER_ID, by default the user of their OUTBOX_AMQP_URL). The
    headers are trusted only on a message whose user_id is one of them: RabbitMQ refuses a
    user_id other than the publisher's own user, so no other user of the vhost can move a
    key's position. Any other message with the headers is applied without the check (its
    position neither checked nor recorded), counted in ``untrusted_order`` and logged
    (action inbox_order_untrusted): refusing it would lose a genuine event to a
    misconfiguration, while applying it is all its publisher could have had anyway.
    ``retries``: runs of a transaction that PostgreSQL aborted with a serialization failure or
    a deadlock (the handler runs again each time; nothing of an aborted run is stored).

    ``metrics``: an ``outbox_relay.inbox_metrics.InboxMetrics`` (prometheus-client's, opt-in):
    messages by outcome, the handler's duration and an applied event's age, labelled with
    ``consumer``, counted by ``process``, ``process_async`` and the helpers.
    Counters, since the inbox was made: ``stale_skipped``, the events ``record`` found STALE
    (each also logged, action inbox_event_stale: its effect was never applied), and
    ``untrusted_order``. A transaction run again (``retries``) counts again.

    The pika and aio-pika helpers run each message in an OpenTelemetry span (outbox_relay.
    tracing) when the service uses OpenTelemetry: its parent is the producer's span, carried by
    the message's traceparent header.
    """

    def __init__(self, table: str = "inbox", *, consumer: str = "default",
                 check_order: bool = False, relay_users: Iterable[str] | None = None,
                 retries: int = 3, metrics: InboxMetrics | None = None) -> None:
        if not isinstance(consumer, str) or not consumer:
            raise ConfigError("consumer must be a non-empty str")
        if retries < 1:
            raise ConfigError("retries must be at least 1")
        self._metrics: ConsumerMetrics | None = None
        if metrics is not None:
            if not hasattr(metrics, "for_consumer"):
                raise ConfigError("metrics must be an outbox_relay.inbox_metrics.InboxMetrics, "
                                  f"got {type(metrics).__name__}")
            self._metrics = metrics.for_consumer(consumer)
        self.table = table
        self.consumer = consumer
        self.check_order = check_order
        self.relay_users = _relay_users(relay_users, check_order)
        self.retries = retries
        self.stale_skipped = 0
        self.untrusted_order = 0
        self._counting = threading.Lock()
        self._tables = _Tables(table)
        queries = api_queries()
        self._record = caller.Statement(self._tables.compose(queries["inbox_record"]))
        self._prune = self._tables.compose(queries["inbox_prune"])
        self._prune_keys = self._tables.compose(queries["inbox_prune_keys"])

    # -- schema and retention -----------------------------------------------------------------

    def schema_sql(self) -> str:
        """This inbox's schema as plain SQL (``inbox_schema_sql``)."""
        return inbox_schema_sql(self.table)

    def migrate(self, conn: psycopg.Connection[Any]) -> None:
        """Create the inbox tables if they do not exist (idempotent; concurrent runs wait for
        each other). Commits unless ``conn`` is already inside a transaction."""
        with conn.transaction():
            # The service's own session and search_path: qualified (sql/api.sql says why).
            conn.execute("SELECT pg_catalog.pg_advisory_xact_lock("
                         "pg_catalog.hashtext('outbox-relay inbox migrate'))")
            conn.execute(self._tables.compose(sql_files.text("inbox.sql")))

    def prune(self, conn: psycopg.Connection[Any], *,
              older_than: float = DEFAULT_RETENTION_SECONDS) -> int:
        """Delete the message ids (of every consumer of this table) processed more than
        ``older_than`` seconds ago, and the per-key positions as old, in batches of
        PRUNE_BATCH rows, each in its own transaction on an autocommit connection; the number
        of message ids deleted. A copy of a message that arrives after its id was pruned is
        applied again: keep ``older_than`` above the longest time between two copies (README,
        "Consuming events")."""
        if not older_than > 0:
            raise ConfigError("older_than must be a positive number of seconds")
        deleted = 0
        for query in (self._prune, self._prune_keys):
            while True:
                with conn.transaction():
                    count = conn.execute(query, {"older_than": older_than,
                                                 "limit": PRUNE_BATCH}).rowcount
                if query is self._prune:
                    deleted += count
                if count < PRUNE_BATCH:
                    break
        return deleted

    # -- the step inside a transaction --------------------------------------------------------

    def _params(self, message: InboxMessage) -> dict[str, Any]:
        key, position = message.ordering_key, message.position
        if not self.check_order or key is None or position is None \
                or message.user_id not in self.relay_users:
            key = position = None
        return {"consumer": self.consumer, "message_id": message.message_id,
                "ordering_key": key, "position": position}

    def _outcome(self, message: InboxMessage, params: Mapping[str, Any],
                 rows: list[tuple[Any, ...]]) -> Outcome:
        recorded, advanced = rows[0]
        if self.check_order and params["ordering_key"] is None \
                and message.ordering_key is not None and message.position is not None:
            self._untrusted(message)
        if not recorded:
            return Outcome.DUPLICATE
        if params["ordering_key"] is not None and not advanced:
            self._stale(message)
            return Outcome.STALE
        return Outcome.APPLIED

    def _count(self, name: str) -> None:
        with self._counting:
            setattr(self, name, getattr(self, name) + 1)

    def _stale(self, message: InboxMessage) -> None:
        self._count("stale_skipped")
        # %r: the key and message id are a producer's text, escaped (no forged log lines).
        log.warning(
            "inbox %s: event %r skipped, handler not run: position %d of key %r is not past "
            "the last one applied", self.consumer, message.message_id, message.position,
            message.ordering_key,
            extra={"action": "inbox_event_stale", "consumer": self.consumer,
                   "message_id": message.message_id, "ordering_key": message.ordering_key,
                   "position": message.position})

    def _untrusted(self, message: InboxMessage) -> None:
        self._count("untrusted_order")
        if self._metrics is not None:
            self._metrics.untrusted_order.inc()
        log.warning(
            "inbox %s: order headers of message %r not trusted (user_id %r is none of "
            "relay_users): applied without the per-key check", self.consumer,
            message.message_id, message.user_id,
            extra={"action": "inbox_order_untrusted", "consumer": self.consumer,
                   "message_id": message.message_id, "user_id": message.user_id,
                   "ordering_key": message.ordering_key, "position": message.position})

    @overload
    def record(self, target: AsyncTarget,
               message: InboxMessage) -> Coroutine[Any, Any, Outcome]: ...

    @overload
    def record(self, target: SyncTarget, message: InboxMessage) -> Outcome: ...

    def record(self, target: Any, message: InboxMessage) -> Any:
        """Record ``message`` in the caller's open transaction, on any connection the producer
        API takes (a coroutine for an asynchronous one). Outcome.APPLIED: first copy, apply
        its effect in this same transaction, then commit, then ack. DUPLICATE or STALE: skip
        the effect; commit (or roll back) and ack. Never commits."""
        params = self._params(message)
        if caller.kind_of(target).is_async:
            return self._record_async(target, message, params)
        return self._outcome(message, params, caller.run(target, self._record, params))

    async def _record_async(self, target: Any, message: InboxMessage,
                            params: dict[str, Any]) -> Outcome:
        return self._outcome(message, params,
                             await caller.run_async(target, self._record, params))

    # -- one transaction: record, handler, commit ---------------------------------------------

    def process(self, conn: psycopg.Connection[Any], message: InboxMessage,
                handler: Handler) -> Outcome:
        """Record ``message`` and run ``handler(conn, message)`` in one transaction on ``conn``,
        committed when this returns; the handler runs only for Outcome.APPLIED. The handler
        does its work on ``conn`` and must not commit. An exception of the handler rolls the
        transaction back and propagates (nothing of the message is stored). ``conn`` must
        have no transaction open."""
        if conn.info.transaction_status != TransactionStatus.IDLE:
            raise InboxError("process() runs and commits its own transaction: call it on a "
                             "connection with no transaction open")
        try:
            outcome = self._process(conn, message, handler)
        except Exception:
            self._counted("failed")
            raise
        self._committed(outcome, message)
        return outcome

    def _process(self, conn: psycopg.Connection[Any], message: InboxMessage,
                 handler: Handler) -> Outcome:
        for attempt in range(1, self.retries + 1):
            try:
                with conn.transaction():
                    outcome = self.record(conn, message)
                    if outcome is Outcome.APPLIED:
                        if self._metrics is None:
                            handler(conn, message)
                        else:
                            started = time.perf_counter()
                            try:
                                handler(conn, message)
                            finally:
                                self._metrics.handler_duration.observe(
                                    time.perf_counter() - started)
                return outcome
            except _RETRYABLE:
                if attempt == self.retries:
                    raise
        raise AssertionError("unreachable")

    async def process_async(self, conn: psycopg.AsyncConnection[Any], message: InboxMessage,
                            handler: AsyncHandler) -> Outcome:
        """``process`` on an asynchronous psycopg connection, with an async handler."""
        if conn.info.transaction_status != TransactionStatus.IDLE:
            raise InboxError("process_async() runs and commits its own transaction: call it on "
                             "a connection with no transaction open")
        try:
            outcome = await self._process_async(conn, message, handler)
        except Exception:
            self._counted("failed")
            raise
        self._committed(outcome, message)
        return outcome

    async def _process_async(self, conn: psycopg.AsyncConnection[Any], message: InboxMessage,
                             handler: AsyncHandler) -> Outcome:
        for attempt in range(1, self.retries + 1):
            try:
                async with conn.transaction():
                    outcome = await self.record(conn, message)
                    if outcome is Outcome.APPLIED:
                        if self._metrics is None:
                            await handler(conn, message)
                        else:
                            started = time.perf_counter()
                            try:
                                await handler(conn, message)
                            finally:
                                self._metrics.handler_duration.observe(
                                    time.perf_counter() - started)
                return outcome
            except _RETRYABLE:
                if attempt == self.retries:
                    raise
        raise AssertionError("unreachable")

    # -- metrics ------------------------------------------------------------------------------

    def _counted(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.outcomes[outcome].inc()

    def _committed(self, outcome: Outcome, message: InboxMessage) -> None:
        """``message``'s transaction committed with ``outcome``: count it, and an applied
        event's age (now minus its AMQP timestamp)."""
        if self._metrics is None:
            return
        self._metrics.outcomes[outcome.value].inc()
        if outcome is Outcome.APPLIED and message.timestamp is not None:
            age = time.time() - message.timestamp.timestamp()
            self._metrics.event_age.observe(max(age, 0.0))

    # -- brokers: ack after the commit --------------------------------------------------------

    @staticmethod
    def _requeue(on_error: OnError, message: InboxMessage | None) -> bool:
        if message is None or on_error is OnError.REJECT:
            return False
        return on_error is OnError.REQUEUE or not message.redelivered

    def handle_pika(self, conn: psycopg.Connection[Any], channel: Any, method: Any,
                    properties: Any, body: bytes, handler: Handler, *,
                    on_error: OnError = OnError.REQUEUE_ONCE) -> Outcome | None:
        """One delivery of a pika channel (consumed with auto_ack off): ``process`` it, then ack
        it; if the handler raised, nack it by ``on_error`` (Outcome None). A message without a
        message_id is rejected without requeue. If the database connection is lost, the
        message is requeued and the error raised (out of ``start_consuming``): reconnect.
        With OpenTelemetry in use, all of it runs in the message's span (``_span``)."""
        tag = method.delivery_tag
        try:
            message = InboxMessage.from_pika(method, properties, body)
        except InboxError as exc:
            self._counted("failed")
            self._log_failure(exc, None, False)
            channel.basic_nack(tag, requeue=False)
            return None
        with self._span(message, tag) as span:
            try:
                outcome = self.process(conn, message, handler)
            except Exception as exc:
                if _connection_lost(conn):
                    span.outcome("failed")  # the span records the exception raised
                    channel.basic_nack(tag, requeue=True)
                    raise
                requeue = self._requeue(on_error, message)
                span.failed(exc)
                self._log_failure(exc, message, requeue)
                channel.basic_nack(tag, requeue=requeue)
                return None
            span.outcome(outcome.value)
            channel.basic_ack(tag)
        return outcome

    def pika_callback(self, conn: psycopg.Connection[Any], handler: Handler, *,
                      on_error: OnError = OnError.REQUEUE_ONCE
                      ) -> Callable[[Any, Any, Any, bytes], None]:
        """A callback for pika's ``channel.basic_consume(queue, callback)`` that runs
        ``handle_pika`` on every delivery."""
        def on_message(channel: Any, method: Any, properties: Any, body: bytes) -> None:
            self.handle_pika(conn, channel, method, properties, body, handler, on_error=on_error)

        return on_message

    async def handle_aio_pika(self, conn: psycopg.AsyncConnection[Any],
                              message: AbstractIncomingMessage, handler: AsyncHandler, *,
                              on_error: OnError = OnError.REQUEUE_ONCE) -> Outcome | None:
        """``handle_pika`` for aio-pika (``async for message in queue.iterator()``, no_ack
        off): ``process_async``, then ack; the same error policy; a lost database connection
        requeues the message and raises. The same span."""
        try:
            inbox_message = InboxMessage.from_aio_pika(message)
        except InboxError as exc:
            self._counted("failed")
            self._log_failure(exc, None, False)
            await message.nack(requeue=False)
            return None
        with self._span(inbox_message, message.delivery_tag) as span:
            try:
                outcome = await self.process_async(conn, inbox_message, handler)
            except Exception as exc:
                if _connection_lost(conn):
                    span.outcome("failed")  # the span records the exception raised
                    await message.nack(requeue=True)
                    raise
                requeue = self._requeue(on_error, inbox_message)
                span.failed(exc)
                self._log_failure(exc, inbox_message, requeue)
                await message.nack(requeue=requeue)
                return None
            span.outcome(outcome.value)
            await message.ack()
        return outcome

    def aio_pika_callback(self, conn: psycopg.AsyncConnection[Any], handler: AsyncHandler, *,
                          on_error: OnError = OnError.REQUEUE_ONCE
                          ) -> Callable[[AbstractIncomingMessage], Awaitable[None]]:
        """A callback for aio-pika's ``queue.consume(callback)`` that runs ``handle_aio_pika``.
        aio-pika only logs what a callback raises: to stop on a lost database connection,
        iterate the queue and call ``handle_aio_pika`` yourself."""
        async def on_message(message: AbstractIncomingMessage) -> None:
            await self.handle_aio_pika(conn, message, handler, on_error=on_error)

        return on_message

    def _span(self, message: InboxMessage,
              delivery_tag: int | None) -> AbstractContextManager[tracing.ConsumerSpan]:
        """The span a helper processes ``message`` in: a CONSUMER span whose parent is the
        message's trace context, with the messaging attributes and the outcome (tracing.py);
        nothing when the service does not use OpenTelemetry."""
        return tracing.consuming(
            consumer=self.consumer, message_id=message.message_id, exchange=message.exchange,
            routing_key=message.routing_key, headers=message.headers,
            body_size=len(message.body), delivery_tag=delivery_tag)

    def _log_failure(self, exc: Exception, message: InboxMessage | None, requeue: bool) -> None:
        log.warning(  # %r: a message id is a producer's text, escaped (no forged log lines)
            "inbox %s: message %s not processed (%s: %s); %s", self.consumer,
            repr(message.message_id) if message else "without message_id", type(exc).__name__, exc,
            "requeued" if requeue else "rejected (dead-lettered if the queue has a DLX)",
            extra={"action": "inbox_message_failed", "consumer": self.consumer,
                   "message_id": message.message_id if message else None,
                   "requeued": requeue})


__all__ = ["DEFAULT_RETENTION_SECONDS", "AsyncHandler", "Handler", "Inbox", "InboxMessage",
           "OnError", "Outcome", "inbox_schema_sql"]
