"""The relay's domain types: what the loop, the store and the publisher hand each other.

No driver here: relay/store.py makes ``OutboxRow``s out of psycopg rows, outbox_relay/rules.py
makes ``Message``s out of them, relay/publisher.py says what the broker did in a
``PublishResult``. Label enums are the metrics' label values (relay/metrics.py declares them).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


class Label(str, enum.Enum):
    """A bounded metric label value; ``str()`` is the value (as prometheus_client writes it)."""

    # A member and its value are one key in dicts and sets (Enum hashes the member's name).
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return str(self.value)


class Server(Label):
    POSTGRESQL = "postgresql"
    RABBITMQ = "rabbitmq"


class Reason(Label):
    """Why a message, or a whole batch, failed (``*_row_failures_total``,
    ``*_batch_failures_total``)."""

    UNROUTABLE = "unroutable"  # returned by the broker (mandatory)
    NACKED = "nacked"
    EXCHANGE_NOT_FOUND = "exchange_not_found"
    CHANNEL_CLOSED = "channel_closed"  # by the broker, before the row's confirm
    CONNECTION_CLOSED = "connection_closed"  # by the broker, for a frame it refused
    UNENCODABLE = "unencodable"  # pika could not encode it
    CONNECTION_LOST = "connection_lost"
    CONFIRM_TIMEOUT = "confirm_timeout"
    LEDGER = "ledger"  # the batch's ledger record failed
    ROW_FAILURES = "row_failures"  # a batch rolled back for its rows' own failures


class BatchOutcome(Label):
    COMMITTED = "committed"
    ROLLED_BACK = "rolled_back"
    FINISHED_ELSEWHERE = "finished_elsewhere"  # by the resolver (or a race) first


class DeadLetterReason(Label):
    INVALID = "invalid"  # can never be published
    EXHAUSTED = "exhausted"  # out of attempts


class Decision(Label):
    """What the resolver did with an in-doubt batch."""

    COMMITTED = "committed"
    ROLLED_BACK = "rolled_back"
    ALREADY_FINISHED = "already_finished"


@dataclass(frozen=True)
class Failure:
    """Why a message or a batch failed: the metric label and the text for logs and last_error."""

    reason: Reason
    detail: str
    # The connection went (or its confirms never came) with messages in flight: their fate is
    # unknown, which counts toward LOST_STREAK_LIMIT (relay/worker.py).
    in_flight_lost: bool = False

    def __str__(self) -> str:
        return self.detail


@dataclass(frozen=True)
class OutboxRow:
    """A claimed outbox row, as raw as the claim can fetch it: nothing a producer writes can
    fail the fetch of a batch. Each row is decoded on its own (``outbox_relay.relay.messages.to_message``)."""

    id: int
    message_id: str
    exchange: str
    routing_key: str
    ordering_key: str | None
    body: bytes  # the payload's JSON text in UTF-8, or payload_bytes
    is_json: bool  # payload (jsonb) rather than payload_bytes
    headers: str  # the headers' JSON text
    content_type: str | None
    created_epoch: float  # created_at in epoch seconds: may be +-inf, negative, past year 9999
    created_at: str  # created_at as text, as the claim session prints it (its dead-letter copy)
    attempts: int
    row_bytes: int = 0  # what the claim fetched of the row (the row_bytes column)
    # Set when the claim itself moved the row to the dead-letter table, too big to be fetched
    # (nothing but id, message_id and attempts is filled in then): the reason.
    dead_reason: str | None = None
    # The AMQP type and correlation_id the producer set (None: the property is not set).
    message_type: str | None = None
    correlation_id: str | None = None


@dataclass(frozen=True)
class Message:
    """One outbox row, ready to publish."""

    row_id: int
    message_id: str
    exchange: str
    routing_key: str
    body: bytes
    properties: Any  # pika.BasicProperties, built by outbox_relay.rules
    ordering_key: str | None = None  # its row's: published after the key's older messages


@dataclass(frozen=True)
class TracedMessage(Message):
    """A Message whose row carried a trace context (headers traceparent, tracestate): what the
    relay's publish span links to, and what it left out as malformed (counted once published).
    A class of its own rather than fields of every Message: one field more cost every message
    1,300 instructions (benchmarks.studies.instructions)."""

    traceparent: str | None = None  # as published (None: none, or left out)
    trace_dropped: str | None = None  # the header left out as malformed, and why


@dataclass(frozen=True)
class Unpublishable:
    """A row that can never be published (``outbox_relay.relay.messages.to_message``): it is dead-lettered."""

    reason: str


@dataclass
class PublishResult:
    """What the broker said about each message of a batch."""

    confirmed: set[int] = field(default_factory=set)
    # Rows the broker refused, each for its own reason (returned, nacked, no such exchange).
    failed: dict[int, Failure] = field(default_factory=dict)
    # Rows unconfirmed when the broker closed the channel: one of them caused it, not known which.
    suspect: dict[int, Failure] = field(default_factory=dict)
    # Set when the connection failed or timed out: the unconfirmed rows' fate is unknown.
    transient: Failure | None = None
    # Rows not sent: an older row of their key failed before it was sent (unencodable).
    held: set[int] = field(default_factory=set)

    def complete(self, total: int) -> bool:
        return (
            len(self.confirmed) == total
            and not self.failed
            and not self.suspect
            and self.transient is None
        )


@dataclass(frozen=True)
class PreparedXact:
    """A row of pg_prepared_xacts."""

    gid: str
    prepared: datetime
    owner: str
    age_seconds: float
    xid: int = 0  # pg_prepared_xacts.transaction
    database: str = ""
    # Whether the preparing role may read the ledger key, as every relay's role must (a
    # superuser may): a role that cannot is no relay's, whatever its gid looks like.
    owner_reads_key: bool = True


@dataclass(frozen=True)
class SessionRole:
    """The role of a PostgreSQL session."""

    name: str
    superuser: bool

    def may_finish(self, owner: str) -> bool:
        """COMMIT/ROLLBACK PREPARED is allowed to the preparing role or a superuser only."""
        return self.superuser or owner == self.name


@dataclass(frozen=True)
class HorizonHolder:
    """The oldest transaction id one kind of holder keeps alive (see the ``xmin_horizon`` query)."""

    xid_age: int
    age_seconds: float | None  # prepared transactions and client sessions' transactions only
    oldest_xid: str | None = None  # that transaction id: the same one scan after scan is held


@dataclass(frozen=True)
class OutboxStats:
    """One stats pass over the outbox rows with ids above ``after`` (sql/queries.sql, stats)."""

    backlog: int  # rows not yet published
    lag: float  # seconds the oldest of them is late
    never_due: int  # rows delayed to the year 10000 or later
    lowest: int | None  # the lowest id seen; None when the pass saw no row
    # The lowest id of a row that is not parked (sql/queries.sql, claim_frontier; None: none).
    lowest_unparked: int | None = None
    # A full pass's: rows below ``lowest`` that the next passes leave out (delayed to a later
    # time, or waiting behind a dead letter of their key; counted in ``backlog``); ``lowest``
    # is then the lowest id of the other rows. How late the oldest of them is (seconds,
    # negative when none is due yet; None: none has a finite created_at).
    parked_below: int = 0
    lag_below: float | None = None
    # A full pass's: the ordering keys whose oldest row is parked (a retry, or due over
    # PARK_HORIZON from now) among the rows below lowest_unparked, each with its lowest id
    # there (None: more than MAX_HELD_KEYS of them), and the lowest of those ids.
    parked_keys: Mapping[str, int] | None = None
    lowest_parked_key: int | None = None
