"""A test double for the services' own unit tests: an outbox that records events, no database.

``RecordingOutbox`` is a target of ``enqueue`` and ``enqueue_many`` and, awaited, of
``enqueue_async`` and ``enqueue_many_async``: the calls check every event exactly as they do
for a real connection (InvalidEvent for what the relay would refuse, the same encoding of the
payload), then record it instead of running the INSERT. It behaves like a connection's
transaction: what is written is pending until ``commit()`` (or the end of a ``transaction()``
block) and gone on ``rollback()``; a message id already written to the same table is refused
as PostgreSQL's unique index refuses it. A test then reads ``events`` (committed, in the order
written) or asserts with ``assert_enqueued``::

    from outbox_relay.testing import RecordingOutbox

    def test_paying_an_order_announces_it() -> None:
        outbox = RecordingOutbox()
        with outbox.transaction():
            pay_order(outbox, order_id=42)        # calls enqueue(outbox, ...) inside
        event = outbox.assert_enqueued(routing_key="order.paid")
        assert event.payload == {"order_id": 42, "amount": "19.90"}

It imports nothing the library does not already load: no pika, no program, no server.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from types import TracebackType
from typing import Any

import psycopg
import psycopg.errors

from outbox_relay.rules import default_content_type


@dataclass(frozen=True)
class RecordedEvent:
    """One event as the relay will publish it."""

    message_id: str
    exchange: str
    routing_key: str
    # The payload as a consumer decodes it (a JSON payload: the value after the API's encoding,
    # so a Decimal is a str), or the bytes as given.
    payload: Any
    # The message body: a JSON payload's text as the API wrote it (PostgreSQL's jsonb sends
    # its own text of the same value: spacing and key order may differ), or the bytes.
    body: bytes
    # The content type the message carries (the default one when none was given).
    content_type: str
    # The event's own headers; the relay adds x-ordering-key and x-outbox-id to a keyed one.
    headers: dict[str, Any]
    ordering_key: str | None
    # None: publish at once (the row's default, now()).
    available_at: datetime | None
    table: str
    # The AMQP type and correlation_id properties (None: not set); a UUID correlation id as
    # its string, as the relay sends it.
    message_type: str | None = None
    correlation_id: str | None = None


_FIELDS = frozenset(f.name for f in fields(RecordedEvent))


class _Done:
    """What commit() and rollback() return: nothing to wait for, awaitable for async code."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield  # a generator function that yields nothing


_DONE = _Done()


class _Block:
    """One ``transaction()`` block: the transaction itself, or a savepoint inside one."""

    def __init__(self, outbox: RecordingOutbox) -> None:
        self._outbox = outbox
        self._savepoint: int | None = None

    def __enter__(self) -> RecordingOutbox:
        outbox = self._outbox
        outbox._check_usable()
        if outbox._open:
            self._savepoint = len(outbox._pending)
        outbox._open = True
        outbox._blocks += 1
        return outbox

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        outbox = self._outbox
        outbox._blocks -= 1
        if self._savepoint is None:  # the outermost block: the transaction
            outbox._end(commit=exc is None)
        elif exc is not None:  # ROLLBACK TO SAVEPOINT: the failure goes with it
            del outbox._pending[self._savepoint:]
            outbox._failed = None
        # psycopg.Rollback leaves the block quietly, as in psycopg.
        return isinstance(exc, psycopg.Rollback)

    async def __aenter__(self) -> RecordingOutbox:
        return self.__enter__()

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        return self.__exit__(kind, exc, tb)


class RecordingOutbox:
    """An outbox in memory for unit tests: the target of enqueue calls, a transaction, and the
    events it recorded. Not thread-safe; one per test."""

    def __init__(self) -> None:
        self._committed: list[RecordedEvent] = []
        self._pending: list[RecordedEvent] = []
        self._open = False  # a transaction is open (begun by a write or a block)
        self._blocks = 0
        self._failed: str | None = None  # why the open transaction is aborted
        self._dropped: list[str] = []  # enqueue_async coroutines never awaited

    # -- what the enqueue functions call ---------------------------------------------------------

    def _write(self, table: str, params: Mapping[str, Sequence[Any]]) -> None:
        """The INSERT of ``enqueue``: ``params`` are its columns (one list each, one element per
        event), as the API made them."""
        self._check_usable()
        self._open = True
        written = {(e.table, e.message_id) for e in (*self._committed, *self._pending)}
        batch = [dict(zip(params, row, strict=True)) for row in zip(*params.values(), strict=True)]
        for row in batch:
            if (table, row["message_id"]) in written:
                name = table.rsplit(".", 1)[-1]
                self._failed = "a statement failed: duplicate message id"
                raise psycopg.errors.UniqueViolation(
                    f'duplicate key value violates unique constraint "{name}_message_id_key"'
                    f" (message_id)=({row['message_id']}) already exists")
        self._pending.extend(_event(table, row) for row in batch)

    def _never_awaited(self, report: str) -> None:
        self._dropped.append(report)

    # -- the transaction -------------------------------------------------------------------------

    def transaction(self) -> _Block:
        """A block (``with`` or ``async with``): a transaction that commits at its end, or rolls
        back if it raises; inside an open transaction, a savepoint (as psycopg's
        ``transaction()``)."""
        return _Block(self)

    def commit(self) -> _Done:
        """Commit what is pending (``await outbox.commit()`` works too). Like PostgreSQL, the
        commit of a transaction a statement failed in rolls it back."""
        self._outside_blocks("commit")
        self._end(commit=True)
        return _DONE

    def rollback(self) -> _Done:
        """Forget what is pending (``await outbox.rollback()`` works too)."""
        self._outside_blocks("rollback")
        self._end(commit=False)
        return _DONE

    def _end(self, *, commit: bool) -> None:
        if commit and self._failed is None:
            self._committed.extend(self._pending)
        self._pending.clear()
        self._open = False
        self._failed = None

    def _outside_blocks(self, what: str) -> None:
        if self._blocks:
            raise psycopg.ProgrammingError(
                f"Explicit {what}() forbidden within a transaction() block: it ends with the "
                "block")

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise psycopg.errors.InFailedSqlTransaction(
                "current transaction is aborted, commands ignored until end of transaction "
                f"block ({self._failed})")

    # -- what a test reads -----------------------------------------------------------------------

    @property
    def events(self) -> list[RecordedEvent]:
        """The committed events, in the order they were written."""
        self._check_dropped()
        return list(self._committed)

    @property
    def pending(self) -> list[RecordedEvent]:
        """The events written in the open transaction, not committed yet."""
        self._check_dropped()
        return list(self._pending)

    def find(self, **expected: Any) -> list[RecordedEvent]:
        """The committed events whose fields equal ``expected`` (``routing_key="order.paid"``,
        ``payload={...}``, ...), in order."""
        unknown = sorted(set(expected) - _FIELDS)
        if unknown:
            raise TypeError(f"RecordedEvent has no field {', '.join(unknown)} "
                            f"(it has {', '.join(sorted(_FIELDS))})")
        return [e for e in self.events if all(getattr(e, k) == v for k, v in expected.items())]

    def assert_enqueued(self, **expected: Any) -> RecordedEvent:
        """The one committed event whose fields equal ``expected``; AssertionError, showing what
        was recorded, if there is none or more than one."""
        found = self.find(**expected)
        if len(found) == 1:
            return found[0]
        wanted = ", ".join(f"{k}={v!r}" for k, v in expected.items())
        raise AssertionError("\n".join([
            f"{len(found)} committed events match {wanted or 'anything'}, expected 1",
            *self._recorded()]))

    def assert_nothing_enqueued(self) -> None:
        """AssertionError if any event was committed or is pending."""
        self._check_dropped()
        if self._committed or self._pending:
            raise AssertionError("\n".join(["events were enqueued", *self._recorded()]))

    def clear(self) -> None:
        """Forget every event, pending or committed, and any failure."""
        self._committed.clear()
        self._dropped.clear()
        self._end(commit=False)

    def _check_dropped(self) -> None:
        if self._dropped:
            raise AssertionError("\n".join(self._dropped))

    def _recorded(self) -> list[str]:
        lines = []
        for title, events in (("committed", self._committed),
                              ("pending, not committed", self._pending)):
            if events:
                lines.append(f"{title}:")
                lines += (f"  exchange={e.exchange!r} routing_key={e.routing_key!r} "
                          f"message_id={e.message_id!r} payload={e.payload!r}"
                          + (f" ordering_key={e.ordering_key!r}" if e.ordering_key else "")
                          for e in events)
        return lines or ["nothing was recorded"]


def _event(table: str, row: Mapping[str, Any]) -> RecordedEvent:
    text: str | None = row["payload"]
    raw: bytes | None = row["payload_bytes"]
    body = raw if raw is not None else (text or "").encode()
    return RecordedEvent(
        message_id=row["message_id"], exchange=row["exchange"], routing_key=row["routing_key"],
        payload=raw if raw is not None else json.loads(text or "null"), body=body,
        content_type=row["content_type"] or default_content_type(raw is None),
        headers=json.loads(row["headers"]), ordering_key=row["ordering_key"],
        available_at=row["available_at"], table=table, message_type=row["message_type"],
        correlation_id=row["correlation_id"])


__all__ = ["RecordedEvent", "RecordingOutbox"]
