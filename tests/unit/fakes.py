"""In-memory fakes of the relay's ``Store`` and ``Publisher`` protocols (``relay/worker.py``).

No server, no socket, no sleep: a whole relay run is a few dictionary operations, so the unit
tests of the loop logic run in milliseconds.

``FakeStore`` models PostgreSQL as the protocol sees it: rows in a dict; ``claim`` opens the
transaction and removes due rows into it; ``prepare`` moves that transaction under its gid;
``finish`` commits or restores it; a lost connection aborts the open transaction but never a
prepared one. ``FakePublisher`` is scripted per row id (confirm, nack, return, channel closed,
connection lost, confirm timeout) and records what was published and what went to the ledger.

Both write to one shared ``journal`` so a test can assert the order of calls across the two
servers, and both can be told to raise on the next call of a method (``fail``). A misuse that the
real servers would reject (claim inside an open transaction, PREPARE without one, publishing on
a closed channel) raises ``ProtocolViolation`` instead of passing silently.

For the resolver (``PreparedStore`` and ``Ledger`` of ``resolver/worker.py``): ``FakeCluster``
is one PostgreSQL server's prepared transactions and session-level advisory locks, shared by
the sessions opened on it (``FakePreparedStore``: one per resolver, ``relay_session`` for a
live relay), with the server's rules: only the preparing role or a superuser may finish a
transaction, one that no longer exists is "already finished" (42704), a session's locks go
with it. ``FakeLedger`` holds records as bytes (any bytes: ``append``) and applies the real
reading and checks (``outbox_relay.ledger.read_record``, ``check_batch``) to those from the
read's start time on.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg

from outbox_relay import ledger
from outbox_relay.compact import Sizes
from outbox_relay.errors import DatabaseError, TransientError
from outbox_relay.model import (
    Failure,
    HorizonHolder,
    Message,
    OutboxRow,
    OutboxStats,
    PreparedXact,
    PublishResult,
    Reason,
    SessionRole,
)
from outbox_relay.postgres import is_connection_error, translate
from outbox_relay.relay.marks import ClaimMarks
from outbox_relay.resolver.compaction import Compaction

CREATED_AT = datetime(2024, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


class ProtocolViolation(AssertionError):
    """The code under test did something the real server would refuse or that breaks the protocol."""


@dataclass
class _Fault:
    exc: BaseException
    apply: bool  # do the call's work first, then raise (the reply was lost)
    disconnect: bool


class _Scripted:
    """Journal, one-shot faults and before-hooks shared by both fakes."""

    def __init__(self, journal: list[str] | None) -> None:
        self.journal: list[str] = journal if journal is not None else []
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self._faults: dict[str, list[_Fault]] = {}
        self._before: dict[str, list[Callable[[], object]]] = {}
        self.is_connected = False

    @property
    def connected(self) -> bool:
        return self.is_connected

    def fail(self, method: str, exc: BaseException, *, apply: bool = False,
             disconnect: bool | None = None) -> None:
        """Raise ``exc`` on the next call of ``method``.

        ``apply``: the server did the work but the reply was lost. ``disconnect`` (default: when
        ``exc`` is a connection error, or a TransientError) also drops the connection.
        """
        if disconnect is None:
            disconnect = is_connection_error(exc) or isinstance(exc, TransientError)
        self._faults.setdefault(method, []).append(_Fault(exc, apply, disconnect))

    def before(self, method: str, hook: Callable[[], object]) -> None:
        """Run ``hook`` once, just before the next call of ``method`` does anything."""
        self._before.setdefault(method, []).append(hook)

    def _enter(self, method: str, entry: str, *, needs_connection: bool = True,
               **args: Any) -> _Fault | None:
        """Record the call; raise a scheduled fault now, or return one to raise after the work."""
        self.journal.append(entry)
        self.calls.append((method, args))
        hooks = self._before.get(method)
        if hooks:
            hooks.pop(0)()
        if needs_connection and not self.is_connected:
            raise ProtocolViolation(f"{type(self).__name__}.{method} called while disconnected")
        faults = self._faults.get(method)
        fault = faults.pop(0) if faults else None
        if fault is not None and not fault.apply:
            self._raise(fault)
        return fault

    def _raise(self, fault: _Fault | None) -> None:
        if fault is None:
            return
        if fault.disconnect:
            self._lose_connection()
        raise self._translate(fault.exc)

    def _translate(self, exc: BaseException) -> BaseException:
        """The error as the real adapter lets it out."""
        return exc

    def _lose_connection(self) -> None:
        self.is_connected = False

    def called(self, method: str) -> list[dict[str, Any]]:
        """The arguments of every call of ``method``, in order."""
        return [args for name, args in self.calls if name == method]


# -- PostgreSQL ---------------------------------------------------------------------------------


class RawHeaders(str):
    """Headers given as the JSON text the claim would fetch (e.g. nested too deep to build)."""


@dataclass
class StoredRow:
    """An outbox row at rest, with the columns the relay never sees (available_at)."""

    id: int
    message_id: str
    exchange: str
    routing_key: str
    ordering_key: str | None
    payload: str | None
    payload_bytes: bytes | None
    headers: Any
    content_type: str | None
    created_at: datetime
    attempts: int = 0
    last_error: str | None = None
    available_at: float = 0.0
    message_type: str | None = None
    correlation_id: str | None = None

    def claimed(self) -> OutboxRow:
        """As the claim fetches it: the body as bytes, headers as JSON text, created_at twice."""
        body = self.payload.encode() if self.payload is not None else bytes(self.payload_bytes or b"")
        return OutboxRow(self.id, self.message_id, self.exchange, self.routing_key, self.ordering_key,
                         body, self.payload is not None,
                         self.headers if isinstance(self.headers, RawHeaders) else json.dumps(self.headers),
                         self.content_type, self.created_at.timestamp(),
                         self.created_at.isoformat(sep=" "), self.attempts,
                         len(body) + len(str(self.headers)) + len(self.message_id),
                         message_type=self.message_type, correlation_id=self.correlation_id)


@dataclass
class DeadRow:
    row: StoredRow
    error: str
    attempts: int
    reason: str  # "invalid" (claim transaction) or "exhausted" (settle_failed)


@dataclass
class Txn:
    claimed: dict[int, StoredRow] = field(default_factory=dict)
    dead: dict[int, tuple[StoredRow, str]] = field(default_factory=dict)


class FakeStore(_Scripted):
    """The outbox, its dead-letter table and PostgreSQL's prepared transactions, in memory.

    ``now`` is the store's clock (seconds, starts at 0); rows are due when ``available_at <= now``.
    Like the real claim query, a due row that failed before (``attempts > 0``) is claimed alone,
    earliest ``available_at`` first; otherwise fresh due rows are claimed in id order.
    """

    def __init__(self, journal: list[str] | None = None, *, retry_alone: bool = True) -> None:
        super().__init__(journal)
        self.retry_alone = retry_alone
        self.rows: dict[int, StoredRow] = {}
        self.open: Txn | None = None
        self.prepared: dict[str, Txn] = {}
        self.xids: dict[str, int] = {}  # gid -> the xid its PREPARE returned
        self.dead_letter: dict[int, DeadRow] = {}
        self.now = 0.0
        self.lag = 0.0
        self._next_id = 1
        self.ledger_key = b"k" * 32
        self.database = "fake"
        self._xid = 1000
        self.marks = ClaimMarks()  # the real store's claims move it; the stats pass lowers it
        self.stats_source = FakeStatsSession(self)  # what stats_session() hands out
        # Someone asked for the whole table: a claim ahead gives up (AHEAD_LOCK_WAIT).
        self.whole_table_requested = False
        self.ahead_gave_up = 0

    # -- test helpers ------------------------------------------------------------------------


    def _translate(self, exc: BaseException) -> BaseException:
        # The real store lets no psycopg error out: tests script driver errors, the relay
        # sees outbox_relay.errors, as from outbox_relay.relay.store.OutboxStore.
        return translate(exc) if isinstance(exc, psycopg.Error) else exc
    def add(self, *, routing_key: str = "event.created", exchange: str = "events",
            payload: str | None = '{"n": 1}', payload_bytes: bytes | None = None,
            headers: Any = None, content_type: str | None = None, message_id: str | None = None,
            attempts: int = 0, available_at: float = 0.0,
            ordering_key: str | None = None, message_type: str | None = None,
            correlation_id: str | None = None) -> int:
        """Insert one row as a producer would; returns its id."""
        row_id = self._next_id
        self._next_id += 1
        self.rows[row_id] = StoredRow(
            row_id, message_id or f"msg-{row_id}", exchange, routing_key, ordering_key,
            payload if payload_bytes is None else None, payload_bytes,
            {} if headers is None else headers, content_type, CREATED_AT, attempts, None,
            available_at, message_type, correlation_id)
        return row_id

    def add_many(self, count: int, **kwargs: Any) -> list[int]:
        return [self.add(**kwargs) for _ in range(count)]

    def locked_ids(self) -> set[int]:
        """Rows claimed by an open or prepared transaction."""
        txns = [*self.prepared.values(), *([self.open] if self.open else [])]
        return {row_id for txn in txns for row_id in txn.claimed}

    def resolve_elsewhere(self, *, commit: bool) -> None:
        """Someone else (the resolver) finishes every prepared transaction."""
        for gid in list(self.prepared):
            self._apply(self.prepared.pop(gid), commit=commit)

    # -- the Store protocol ------------------------------------------------------------------

    def connect(self, lock_class: int, instance: int) -> None:
        fault = self._enter("connect", "pg_connect", needs_connection=False,
                            lock_class=lock_class, instance=instance)
        self.is_connected = True
        self._raise(fault)

    def close(self) -> None:
        self._enter("close", "pg_close", needs_connection=False)
        self._lose_connection()

    def reset(self) -> None:
        self._enter("reset", "reset", needs_connection=False)
        if self.is_connected:
            self._abort_open()

    def claim(self, limit: int, max_bytes: int = 1 << 60, *, max_message_bytes: int = 1 << 60,
              one_row_at_least: bool = True) -> list[OutboxRow]:
        fault = self._enter("claim", "claim", limit=limit, max_bytes=max_bytes,
                            one_row_at_least=one_row_at_least)
        if self.open is not None:
            raise ProtocolViolation("claim (BEGIN) inside an open transaction")
        if self.whole_table_requested and not one_row_at_least:
            self.ahead_gave_up += 1  # rolled back, nothing claimed, as the real store
            self._raise(fault)
            return []
        due = [r for r in self.rows.values() if r.available_at <= self.now]
        retry = sorted((r for r in due if r.attempts > 0 and self._in_order(r, [])),
                       key=lambda r: (r.available_at, r.id))
        # A claim ahead takes no retried row beyond its budget either.
        retry = [r for r in retry if one_row_at_least or r.claimed().row_bytes <= max_bytes]
        if self.retry_alone and retry:
            taken = retry[:1]
        else:
            pool = due if not self.retry_alone else [r for r in due if r.attempts <= 0]
            taken = []
            total = 0
            for row in sorted(pool, key=lambda r: r.id):
                if len(taken) >= limit:
                    break
                if not self._in_order(row, taken):
                    continue  # its key waits for an older row (per-key order)
                size = row.claimed().row_bytes
                if (taken or not one_row_at_least) and total + size > max_bytes:
                    break  # the byte budget; one row at least, unless a claim ahead
                taken.append(row)
                total += size
        self.open = Txn({r.id: self.rows.pop(r.id) for r in taken})
        self._raise(fault)
        return [r.claimed() for r in taken]

    def _in_order(self, row: StoredRow, taken: list[StoredRow]) -> bool:
        """Per-key order, as the real claim keeps it: every older row of the key is gone or
        taken by this claim (rows of prepared batches are still there), and no dead letter."""
        key = row.ordering_key
        if key is None:
            return True
        if any(dead.row.ordering_key == key for dead in self.dead_letter.values()):
            return False
        mine = {r.id for r in taken}
        prepared = [r for txn in self.prepared.values() for r in txn.claimed.values()]
        return all(other.id in mine for other in [*self.rows.values(), *prepared]
                   if other.ordering_key == key and other.id < row.id)

    def dead_letter_rows(self, reasons: Mapping[int, str]) -> list[int]:
        fault = self._enter("dead_letter_rows", "dead_letter_rows", reasons=dict(reasons))
        if self.open is not None:
            raise ProtocolViolation("dead_letter_rows inside the claim transaction")
        moved = []
        for row_id, error in reasons.items():
            row = self.rows.pop(row_id, None)
            if row is not None:
                self.dead_letter[row_id] = DeadRow(row, error, row.attempts + 1, "invalid")
                moved.append(row_id)
        self._raise(fault)
        return moved

    def dead_letter_claimed(self, rows: Sequence[tuple[OutboxRow, str]]) -> None:
        fault = self._enter("dead_letter_claimed", "dead_letter_claimed",
                            rows=[(r.id, error) for r, error in rows])
        if self.open is None:
            raise ProtocolViolation("dead_letter_claimed outside the claim transaction")
        for row, error in rows:
            if row.id not in self.open.claimed:
                raise ProtocolViolation(f"row {row.id} dead-lettered but not claimed")
            self.open.dead[row.id] = (self.open.claimed[row.id], error)
        self._raise(fault)

    def rollback(self) -> None:
        fault = self._enter("rollback", "rollback")
        self._abort_open()
        self._raise(fault)

    def prepare(self, gid: str) -> int:
        fault = self._enter("prepare", "prepare", gid=gid)
        if self.open is None:
            raise ProtocolViolation("PREPARE TRANSACTION without an open transaction")
        if gid in self.prepared:
            raise ProtocolViolation(f"transaction identifier {gid!r} is already in use")
        self.prepared[gid], self.open = self.open, None
        self._xid += 1
        self.xids[gid] = self._xid
        self._raise(fault)
        return self._xid

    def finish(self, gid: str, *, commit: bool) -> bool:
        fault = self._enter("finish", "commit_prepared" if commit else "rollback_prepared",
                            gid=gid, commit=commit)
        # COMMIT/ROLLBACK PREPARED run on the main session; ``open`` is the claim session's
        # transaction (the next batch, claimed ahead), which they may overlap.
        txn = self.prepared.pop(gid, None)
        if txn is not None:
            self._apply(txn, commit=commit)
        self._raise(fault)
        return txn is not None

    def settle_failed(self, delivered: Sequence[int], failures: Mapping[int, str],
                      attributed: Sequence[int], *, max_attempts: int, base_delay: float,
                      max_delay: float) -> list[int]:
        fault = self._enter("settle_failed", "settle_failed", delivered=list(delivered),
                            failures=dict(failures), attributed=list(attributed),
                            max_attempts=max_attempts, base_delay=base_delay, max_delay=max_delay)
        # The main session's own transaction: the claim session may hold the next batch's
        # claim meanwhile, whose rows are locked (not in self.rows) as in PostgreSQL.
        # Rows locked by another transaction are skipped (SKIP LOCKED): they are not in self.rows.
        for row_id in delivered:
            self.rows.pop(row_id, None)
        for row_id, error in failures.items():
            row = self.rows.get(row_id)
            if row is None:
                continue
            row.available_at = self.now + min(max_delay, base_delay * 2 ** row.attempts)
            row.attempts += 1
            row.last_error = error
        dead = []
        for row_id in attributed:
            row = self.rows.get(row_id)
            if row is not None and row.attempts >= max_attempts:
                del self.rows[row_id]
                self.dead_letter[row_id] = DeadRow(row, row.last_error or "unknown error",
                                                   row.attempts, "exhausted")
                dead.append(row_id)
        self._raise(fault)
        return dead

    def stats_session(self) -> FakeStatsSession:
        return self.stats_source

    def keepalive(self) -> None:
        """Recorded in ``calls`` only (not journaled: it changes nothing)."""
        self.calls.append(("keepalive", {}))
        if not self.is_connected:
            raise ProtocolViolation("FakeStore.keepalive called while disconnected")

    def dead_letter_never_due(self, limit: int) -> list[tuple[int, str, str]]:
        """Rows with ``available_at`` infinite (a key's oldest only), as the real query."""
        fault = self._enter("dead_letter_never_due", "dead_letter_never_due", limit=limit)
        moved = []
        for row in sorted(self.rows.values(), key=lambda r: r.id):
            if len(moved) >= limit or row.available_at != float("inf"):
                continue
            if row.ordering_key is not None and any(
                    other.ordering_key == row.ordering_key and other.id < row.id
                    for other in [*self.rows.values(),
                                  *(r for t in self.prepared.values() for r in t.claimed.values())]):
                continue
            reason = "available_at 'infinity' is never due (a date before the year 10000 is required)"
            del self.rows[row.id]
            self.dead_letter[row.id] = DeadRow(row, reason, row.attempts + 1, "invalid")
            moved.append((row.id, row.message_id, reason))
        self._raise(fault)
        return moved

    # -- internals ---------------------------------------------------------------------------

    def _apply(self, txn: Txn, *, commit: bool) -> None:
        if commit:
            for row_id, (row, error) in txn.dead.items():
                self.dead_letter[row_id] = DeadRow(row, error, row.attempts + 1, "invalid")
        else:
            self.rows.update(txn.claimed)

    def _abort_open(self) -> None:
        if self.open is not None:
            self.rows.update(self.open.claimed)
            self.open = None

    def _lose_connection(self) -> None:
        # The server aborts the session's open transaction; prepared ones survive.
        super()._lose_connection()
        self._abort_open()


# -- RabbitMQ -----------------------------------------------------------------------------------


class Outcome(enum.Enum):
    CONFIRM = "confirm"
    NACK = "nack"
    RETURN = "return"  # basic.return (unroutable), then the ack
    CLOSE_CHANNEL = "close_channel"  # the broker closes the channel: this and every later row suspect
    LOSE_CONNECTION = "lose_connection"  # the socket dies here: this and every later row unknown
    TIMEOUT = "timeout"  # no confirm within the confirm timeout: the batch is transient


CHANNEL_CLOSED = "channel closed by the broker: (406, 'PRECONDITION_FAILED - message rejected')"


@dataclass(frozen=True)
class LedgerRecord:
    gid: str
    count: int
    instance: str
    xid: int = 0


class FakePublisher(_Scripted):
    """A confirm-mode channel whose answer for each row is scripted (default: confirm).

    Simplification: rows before a channel close or a lost connection are confirmed (the real
    publisher may still be waiting for their confirms; then they are suspect or unknown too).
    """

    def __init__(self, journal: list[str] | None = None, *, missing: set[str] | None = None,
                 confirm_timeout: float = 30.0) -> None:
        super().__init__(journal)
        self.missing: set[str] = set(missing or ())
        self.confirm_timeout = confirm_timeout
        self._script: dict[int, list[tuple[Outcome, int | None]]] = {}
        self.batches: list[list[Message]] = []  # every publish_batch call
        self.published: list[Message] = []  # every message written to the channel
        self.confirmed: list[Message] = []  # every message the broker confirmed
        self.ledger: list[LedgerRecord] = []
        self.records: list[dict[str, Any]] = []  # the ledger records as written (signed)
        self.negotiated_frame_max = 131072
        self.user_id: str | None = "relay-user"  # the connection's user, as the real one knows it
        self.exchange_checks: list[set[str]] = []
        self.idles: list[float] = []

    def script(self, row_id: int, outcome: Outcome, *, times: int | None = None) -> None:
        """The broker's answer for ``row_id``: always, or for its next ``times`` publishes."""
        self._script.setdefault(row_id, []).append((outcome, times))

    def published_ids(self) -> list[int]:
        return [m.row_id for m in self.published]

    def _outcome(self, row_id: int) -> Outcome:
        steps = self._script.get(row_id)
        if not steps:
            return Outcome.CONFIRM
        outcome, times = steps[0]
        if times is not None:
            if times <= 1:
                steps.pop(0)
            else:
                steps[0] = (outcome, times - 1)
        return outcome

    # -- the Publisher protocol --------------------------------------------------------------

    def connect(self) -> None:
        fault = self._enter("connect", "amqp_connect", needs_connection=False)
        self.is_connected = True
        self._raise(fault)

    def close(self) -> None:
        self._enter("close", "amqp_close", needs_connection=False)
        self._lose_connection()

    def idle(self, seconds: float) -> None:
        self._enter("idle", "idle", needs_connection=False, seconds=seconds)
        self.idles.append(seconds)

    def missing_exchanges(self, names: set[str]) -> dict[str, Failure]:
        fault = self._enter("missing_exchanges", "missing_exchanges", names=set(names))
        self.exchange_checks.append(set(names))
        self._raise(fault)
        return {name: Failure(Reason.EXCHANGE_NOT_FOUND, f"exchange {name!r} not found "
                              f"(404 NOT_FOUND - no exchange {name!r} in vhost '/')")
                for name in names if name in self.missing}

    def publish_batch(self, messages: Sequence[Message],
                      while_waiting: Callable[[], None] | None = None) -> PublishResult:
        fault = self._enter("publish_batch", "publish", row_ids=[m.row_id for m in messages])
        self.batches.append(list(messages))
        result = PublishResult()
        pending: set[int] = set()
        stopped: Failure | None = None
        for message in messages:
            self.published.append(message)
            outcome = self._outcome(message.row_id)
            if outcome is Outcome.CONFIRM:
                result.confirmed.add(message.row_id)
                self.confirmed.append(message)
            elif outcome is Outcome.NACK:
                # As the real one: a suspect; the channel is replaced, the batch goes on.
                result.suspect[message.row_id] = Failure(Reason.NACKED, "nacked by the broker")
            elif outcome is Outcome.RETURN:
                result.failed[message.row_id] = Failure(Reason.UNROUTABLE, (
                    f"unroutable: 312 NO_ROUTE (exchange {message.exchange!r}, "
                    f"routing key {message.routing_key!r})"))
            elif outcome is Outcome.TIMEOUT:
                pending.add(message.row_id)
            else:
                stopped = (Failure(Reason.CHANNEL_CLOSED, CHANNEL_CLOSED)
                           if outcome is Outcome.CLOSE_CHANNEL else None)
                result.transient = None if stopped else Failure(
                    Reason.CONNECTION_LOST, "RabbitMQ connection lost: ConnectionResetError",
                    in_flight_lost=True)
                self._lose_connection()
                break
        if while_waiting is not None and stopped is None and result.transient is None:
            while_waiting()  # as the real one: every message written, confirms not awaited
        unconfirmed = ({m.row_id for m in messages} - result.confirmed - result.failed.keys()
                       - result.suspect.keys())
        if stopped is not None:
            result.suspect.update(dict.fromkeys(sorted(unconfirmed), stopped))
        elif pending and result.transient is None:
            result.transient = Failure(Reason.CONFIRM_TIMEOUT,
                                       f"no confirm within {self.confirm_timeout:g} s",
                                       in_flight_lost=True)
            self._lose_connection()
        self._raise(fault)
        return result

    @property
    def frame_max(self) -> int:
        return self.negotiated_frame_max

    def record_batch(self, gid: str, record: bytes) -> None:
        body = json.loads(record)
        fault = self._enter("record_batch", "ledger", gid=gid, count=body["count"],
                            instance=body["relay"])
        self.records.append(body)
        self.ledger.append(LedgerRecord(gid, body["count"], body["relay"], body["xid"]))
        self._raise(fault)


class StopWhen:
    """A shutdown (``outbox_relay.runtime.signals.Stop``) that stops once ``predicate()`` is true and records
    the loop's waits instead of sleeping them."""

    def __init__(self, predicate: Callable[[], bool] = lambda: False) -> None:
        self.predicate = predicate
        self.waits: list[float] = []

    @property
    def requested(self) -> bool:
        return self.predicate()

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        return self.requested


class FakeStatsSession(_Scripted):
    """The relay's stats session on a FakeStore (``StatsSource``, outbox_relay/runtime/stats.py):
    a session of its own, journaled in the store's journal as ``stats``. ``unreachable``: what
    connect raises while set."""

    def __init__(self, store: FakeStore) -> None:
        super().__init__(store.journal)
        self.store = store
        self.connects = 0
        self.unreachable: BaseException | None = None

    def connect(self) -> None:
        self.connects += 1
        if self.unreachable is not None:
            raise self.unreachable
        self.is_connected = True

    def close(self) -> None:
        self.is_connected = False

    def _translate(self, exc: BaseException) -> BaseException:
        return translate(exc) if isinstance(exc, psycopg.Error) else exc

    def stats(self, after: int, floor: int = 0) -> OutboxStats:
        """The rows above ``after`` (claimed ones included: not published yet), as the query."""
        fault = self._enter("stats", "stats", after=after)
        store = self.store
        ids = [row_id for row_id in [*store.rows, *store.locked_ids()] if row_id > after]
        never_due = sum(1 for row in store.rows.values()
                        if row.id > after and row.available_at == float("inf"))
        self._raise(fault)
        lowest = min(ids, default=None)
        return OutboxStats(len(ids), store.lag, never_due, lowest, lowest)


# -- the resolver's servers -----------------------------------------------------------------------

LEDGER_KEY = b"k" * 32
T0 = datetime(2024, 1, 1, tzinfo=timezone.utc)
RELAY_ROLE = SessionRole("relay", superuser=False)  # the relays' role, which prepares


class FakeCluster:
    """One PostgreSQL server as the resolver sees it: prepared transactions, advisory locks
    (held per session, released when the session ends) and a clock (seconds since T0)."""

    def __init__(self, database: str = "app") -> None:
        self.database = database
        # Roles that may read the ledger key (GRANT SELECT, or superusers): a relay's role is
        # one of them; any other role's prepared transaction is no relay's.
        self.key_readers = {"relay", "other_relays", "postgres"}
        self.now = 0.0
        self.prepared: dict[str, tuple[PreparedXact, float]] = {}  # gid -> (xact, prepared at)
        self.locks: dict[tuple[int, int], str] = {}  # (class, instance) -> holding session
        self.finished: list[tuple[str, bool, str]] = []  # (gid, commit, by session)
        self.horizon: dict[str, HorizonHolder] = {}
        self.max_prepared = 64  # max_prepared_transactions
        self.stats: tuple[int, float] | DatabaseError = (0, 0.0)
        self._xid = 1000

    def prepare(self, gid: str, *, at: float | None = None, owner: str = "relay") -> PreparedXact:
        """A relay's PREPARE TRANSACTION."""
        self._xid += 1
        when = self.now if at is None else at
        xact = PreparedXact(gid, T0 + timedelta(seconds=when), owner, 0.0, xid=self._xid,
                            database=self.database, owner_reads_key=owner in self.key_readers)
        self.prepared[gid] = (xact, when)
        return xact

    def hold_lock(self, lock_class: int, instance: int, session: str) -> bool:
        holder = self.locks.setdefault((lock_class, instance), session)
        return holder == session

    def end_session(self, session: str) -> None:
        """The session is gone (its process died): PostgreSQL releases its advisory locks."""
        self.locks = {key: holder for key, holder in self.locks.items() if holder != session}

    def finish_elsewhere(self, gid: str, *, commit: bool) -> None:
        """Someone else (a relay, another resolver) finished it first."""
        del self.prepared[gid]
        self.finished.append((gid, commit, "elsewhere"))


class FakePreparedStore:
    """A resolver's session on a FakeCluster (the ``PreparedStore`` protocol)."""

    def __init__(self, cluster: FakeCluster, *, name: str = "resolver",
                 role: SessionRole = RELAY_ROLE) -> None:
        self.cluster = cluster
        self.name = name
        self._role = role
        self.role = SessionRole("", superuser=False)
        self.ledger_key = b""
        self.is_connected = False
        self.unreachable: TransientError | None = None  # connect raises it while set
        self.blocked = 0  # what blocked_keys answers
        self.sizes = Sizes(0, 0, 0, 0)  # what sizes answers
        self.compactions_due: list[bool] = []  # whether due, at each compact_if_due

    @property
    def connected(self) -> bool:
        return self.is_connected

    def connect(self) -> None:
        if self.unreachable is not None:
            raise self.unreachable
        self.is_connected, self.role, self.ledger_key = True, self._role, LEDGER_KEY

    def close(self) -> None:
        self.is_connected = False
        self.cluster.end_session(self.name)

    def _session(self) -> FakeCluster:
        if not self.is_connected:
            raise ProtocolViolation(f"{self.name}: statement on a closed session")
        return self.cluster

    def prepared(self, prefix: str) -> list[PreparedXact]:
        cluster = self._session()
        listed = [replace(xact, age_seconds=cluster.now - at)
                  for xact, at in cluster.prepared.values() if xact.gid.startswith(prefix + ":")]
        return sorted(listed, key=lambda x: x.prepared)

    def try_instance_lock(self, lock_class: int, instance: int) -> bool:
        return self._session().hold_lock(lock_class, instance, self.name)

    def instance_unlock(self, lock_class: int, instance: int) -> None:
        cluster = self._session()
        if cluster.locks.get((lock_class, instance)) != self.name:
            raise ProtocolViolation(f"{self.name} unlocks a lock it does not hold")
        del cluster.locks[(lock_class, instance)]

    def finish(self, gid: str, *, commit: bool) -> bool:
        cluster = self._session()
        found = cluster.prepared.get(gid)
        if found is None:
            return False  # 42704: someone else finished it
        if not (self.role.superuser or found[0].owner == self.role.name):
            raise DatabaseError("permission denied to finish prepared transaction",
                                sqlstate="42501")
        del cluster.prepared[gid]
        cluster.finished.append((gid, commit, self.name))
        return True

    def xmin_horizon(self, prefix: str) -> dict[str, HorizonHolder]:
        return dict(self._session().horizon)

    def prepared_slots(self) -> tuple[int, int]:
        cluster = self._session()
        return len(cluster.prepared), cluster.max_prepared

    def stats_session(self) -> FakeResolverStatsSession:
        return FakeResolverStatsSession(self)

    # What the stats session answers (a test's subclass may script them).
    def outbox_stats(self) -> tuple[int, float]:
        stats = self.cluster.stats
        if isinstance(stats, DatabaseError):
            raise stats
        return stats

    def blocked_keys(self) -> int:
        return self.blocked

    def watch(self, prefix: str, lock_class: int) -> tuple[list[str], list[int]]:
        cluster = self._session()
        return ([gid for gid in cluster.prepared if gid.startswith(prefix + ":")],
                [instance for (cls, instance) in cluster.locks if cls == lock_class])


class FakeResolverStatsSession:
    """The resolver's stats session (``OutboxStatsSource``, resolver/worker.py): a session of
    its own on the cluster, answering with its store's ``outbox_stats`` and ``blocked_keys``.
    ``unreachable``: what connect raises while set."""

    def __init__(self, store: FakePreparedStore) -> None:
        self.store = store
        self.is_connected = False
        self.connects = 0
        self.unreachable: BaseException | None = None

    @property
    def connected(self) -> bool:
        return self.is_connected

    def connect(self) -> None:
        self.connects += 1
        if self.unreachable is not None:
            raise self.unreachable
        self.is_connected = True

    def close(self) -> None:
        self.is_connected = False

    def stats(self, after: int, floor: int = 0) -> OutboxStats:
        if not self.is_connected:
            raise ProtocolViolation("stats on a closed session")
        backlog, lag = self.store.outbox_stats()
        return OutboxStats(backlog, lag, 0, None)

    def blocked_keys(self) -> int:
        return self.store.blocked_keys()

    def sizes(self) -> Sizes:
        return self.store.sizes

    def compact_if_due(self, compaction: Compaction, sizes: Sizes) -> None:
        """Records whether it was due, and marks it done (the rewrite is PostgreSQL's)."""
        due = compaction.after.due()
        self.store.compactions_due.append(due)
        if due:
            compaction.after.done()


@dataclass
class LedgerRead:
    since: datetime
    candidates: dict[str, ledger.Expected]


class FakeLedger:
    """The ledger stream (the ``Ledger`` protocol): records with the time they were appended.
    A read returns what the real one would: the authentic records of the candidates from
    ``since`` on (the marker proves nothing later is missing), rejecting the others."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster  # its clock stamps the records
        self.records: list[tuple[datetime, bytes]] = []  # (appended at, body)
        self.reads: list[LedgerRead] = []
        self.is_connected = False
        self.during_read: list[Callable[[], object]] = []  # run once each, inside a read
        self.failures: list[TransientError] = []  # raised by the next reads
        self.lost_at_end: list[TransientError] = []  # raised by the next reads, once read

    @property
    def connected(self) -> bool:
        return self.is_connected

    def connect(self) -> None:
        self.is_connected = True

    def close(self) -> None:
        self.is_connected = False

    def record(self, xact: PreparedXact, *, count: int = 1, key: bytes = LEDGER_KEY,
               xid: int | None = None, database: str | None = None,
               tampered: dict[str, Any] | None = None) -> None:
        """A relay's signed ledger record of ``xact`` (or, given ``xid``/``database``, of
        another prepared transaction with its gid); ``tampered`` fields change after signing."""
        body = json.loads(ledger.batch_record(
            key, gid=xact.gid, xid=xact.xid if xid is None else xid,
            database=xact.database if database is None else database, count=count,
            relay="00000abc"))
        body.update(tampered or {})
        self.append(json.dumps(body).encode())

    def append(self, body: bytes) -> None:
        """Any bytes, as any user of the vhost may append them."""
        self.records.append((T0 + timedelta(seconds=self.cluster.now), body))

    def committed(self, key: bytes, since: datetime, candidates: Mapping[str, ledger.Expected], *,
                  on_progress: Callable[[], None],
                  on_rejected: Callable[[ledger.Rejected], None]) -> ledger.Found:
        if not self.is_connected:
            raise ProtocolViolation("ledger read while disconnected")
        self.reads.append(LedgerRead(since, dict(candidates)))
        while self.during_read:
            self.during_read.pop(0)()
        if self.failures:
            raise self.failures.pop(0)
        found = ledger.Found()
        read = [offset for offset, (at, _body) in enumerate(self.records) if at >= since]
        for offset in read:
            body = self.records[offset][1]
            record = ledger.read_record(body, offset=offset)
            if isinstance(record, ledger.Rejected):
                on_rejected(record)
                continue
            verdict = ledger.check_batch(record, key=key, candidates=candidates, offset=offset)
            if isinstance(verdict, ledger.Rejected):
                on_rejected(verdict)
            elif verdict is not None:
                found[record["gid"]] = verdict
        if self.lost_at_end:  # the connection lost after the records, before the marker
            raise self.lost_at_end.pop(0)
        # The real read ends on its own marker, appended now: one offset past the last record.
        found.span = (read[0] if read else len(self.records), len(self.records))
        on_progress()
        return found
