"""The producer side: add events to the outbox inside the caller's own transaction.

``enqueue`` writes one event, ``enqueue_many`` any number in one statement (one round trip).
Both check every event against the relay's own rules first (outbox_relay.rules.publish_problem,
the function the relay dead-letters rows with) and raise InvalidEvent naming the field, so a bad
event fails in the producer, before anything is written and with the caller's transaction still
usable, instead of becoming a dead letter later. Neither commits: the event commits or rolls
back with the caller's own change. The targets they take are listed in outbox_relay.caller; given an
asynchronous one (psycopg AsyncConnection or AsyncCursor, SQLAlchemy AsyncSession or
AsyncConnection) they return a coroutine to await.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import TYPE_CHECKING, Any, TypeAlias, overload

import psycopg

from outbox_relay import caller, schema
from outbox_relay.errors import ConfigError, InvalidEvent
from outbox_relay.rules import (
    DEFAULT_FRAME_MAX,
    DEFAULT_LEDGER_STREAM,
    DEFAULT_MAX_MESSAGE_BYTES,
    RELAY_HEADERS,
    message_headers,
    publish_problem,
)
from outbox_relay.sql import api_queries
from outbox_relay.tables import Tables, table_name

if TYPE_CHECKING:
    from sqlalchemy import Connection as SAConnection
    from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
    from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session
    from sqlalchemy.orm import Session, scoped_session

    # What the API takes (outbox_relay.caller): a Django connection or cursor is a DBAPICursor or
    # is typed Any by Django itself.
    SyncTarget: TypeAlias = (psycopg.Connection[Any] | psycopg.Cursor[Any] | Session
                             | scoped_session[Any] | SAConnection | caller.DBAPICursor)
    AsyncTarget: TypeAlias = (psycopg.AsyncConnection[Any] | psycopg.AsyncCursor[Any]
                              | AsyncSession | async_scoped_session[Any] | SAAsyncConnection)

# An id larger than any the outbox will give: the headers of a keyed event are checked with
# the position header at its largest encoding.
_LARGEST_ID = 2**63 - 1
# A JSON text holding a NUL character (\u0000 not preceded by an escaped backslash): jsonb
# refuses it.
_JSON_NUL_RE = re.compile(r"(?:^|[^\\])(?:\\\\)*\\u0000")


@dataclass(frozen=True)
class Event:
    """One event for ``enqueue_many``; the fields are the arguments of ``enqueue``."""

    exchange: str
    routing_key: str
    payload: Any
    message_id: str | None = None
    ordering_key: str | None = None
    headers: Mapping[str, Any] | None = None
    content_type: str | None = None
    available_at: datetime | None = None


@dataclass(frozen=True)
class _Row:
    message_id: str
    exchange: str
    routing_key: str
    ordering_key: str | None
    payload: str | None  # JSON text
    payload_bytes: bytes | None
    headers: str  # JSON text
    content_type: str | None
    available_at: datetime | None


def _check_table(table: str) -> None:
    """The relay's own rule for OUTBOX_TABLE: a name it could not use is refused here too."""
    if not isinstance(table, str):
        raise ConfigError(f"table must be a str, got {type(table).__name__}")
    try:
        table_name(table)
    except ValueError as exc:
        raise ConfigError(f"table {table!r} {exc}") from None


@cache
def _statement(table: str) -> caller.Statement:
    _check_table(table)
    return caller.Statement(Tables(table).compose(api_queries()["enqueue"]))


def _text(field: str, value: object, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        wanted = "a str or None" if optional else "a str"
        raise InvalidEvent(field, f"must be {wanted}, got {type(value).__name__}")
    if "\x00" in value:
        raise InvalidEvent(field, "contains a NUL character, which PostgreSQL text cannot hold")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise InvalidEvent(field, f"is not valid UTF-8 text ({exc.reason})") from None
    return value


def _json(field: str, value: object) -> str:
    """``value`` as the JSON text PostgreSQL will store (jsonb refuses NaN, Infinity, \\u0000)."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidEvent(field, f"is not JSON-serializable: {exc}") from None
    if _JSON_NUL_RE.search(text):
        raise InvalidEvent(field, "contains a NUL character (\\u0000), which jsonb cannot hold")
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise InvalidEvent(field, f"holds text that is not valid UTF-8 ({exc.reason})") from None
    return text


def _headers(value: object) -> tuple[dict[str, Any], str]:
    """The headers as the relay will read them back from jsonb, and their JSON text."""
    if value is None:
        return {}, "{}"
    if not isinstance(value, Mapping):
        raise InvalidEvent("headers", f"must be a mapping, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise InvalidEvent("headers", f"keys must be str, got {type(key).__name__}")
        if key in RELAY_HEADERS:
            raise InvalidEvent("headers", f"{key} is set by the relay (from ordering_key and "
                                          "the row's id); pass ordering_key instead")
    text = _json("headers", dict(value))
    return json.loads(text), text


def _row(event: Event, max_message_bytes: int) -> _Row:
    exchange = _text("exchange", event.exchange)
    routing_key = _text("routing_key", event.routing_key)
    message_id = _text("message_id", event.message_id, optional=True) or str(uuid.uuid4())
    ordering_key = _text("ordering_key", event.ordering_key, optional=True)
    content_type = _text("content_type", event.content_type, optional=True)
    assert exchange is not None and routing_key is not None
    available_at = event.available_at
    if available_at is not None and (
            not isinstance(available_at, datetime) or available_at.utcoffset() is None):
        raise InvalidEvent("available_at", "must be a timezone-aware datetime or None "
                                           "(a naive one would be read in the session's TimeZone)")
    payload: str | None = None
    payload_bytes: bytes | None = None
    if isinstance(event.payload, (bytes, bytearray, memoryview)):
        payload_bytes = bytes(event.payload)
        body_size = len(payload_bytes)
    else:
        payload = _json("payload", event.payload)
        body_size = len(payload.encode())
    headers, headers_text = _headers(event.headers)
    # The relay's checks with the relay's defaults for what the producer cannot see (the
    # broker's frame_max, OUTBOX_LEDGER_STREAM); created_at is now.
    found = publish_problem(
        message_id=message_id, exchange=exchange, routing_key=routing_key, body_size=body_size,
        headers=message_headers(headers, ordering_key, _LARGEST_ID), content_type=content_type,
        json_payload=payload is not None, max_message_bytes=max_message_bytes,
        frame_max=DEFAULT_FRAME_MAX, ledger_stream=DEFAULT_LEDGER_STREAM, headers_text=headers_text)
    if found is not None:
        raise InvalidEvent(found.field, found.reason)
    return _Row(message_id, exchange, routing_key, ordering_key, payload, payload_bytes,
                headers_text, content_type, available_at)


def _prepare(events: Iterable[Event], table: str, max_message_bytes: int, *,
             single: bool) -> tuple[caller.Statement, dict[str, list[Any]], list[str]]:
    statement = _statement(table)
    rows: list[_Row] = []
    for index, event in enumerate(events):
        if not isinstance(event, Event):
            raise TypeError(f"event {index}: expected an outbox Event, got {type(event).__name__}")
        try:
            rows.append(_row(event, max_message_bytes))
        except InvalidEvent as exc:
            if single:
                raise
            raise InvalidEvent(exc.field, exc.reason, index=index) from None
    ids = [r.message_id for r in rows]
    seen: set[str] = set()
    for index, message_id in enumerate(ids):
        if message_id in seen:
            raise InvalidEvent("message_id", f"{message_id!r} appears twice in the batch",
                               index=index)
        seen.add(message_id)
    params = {name: [getattr(r, name) for r in rows] for name in _Row.__dataclass_fields__}
    return statement, params, ids


async def _run_async(target: Any, statement: caller.Statement, params: dict[str, list[Any]],
                     ids: list[str]) -> list[str]:
    if ids:
        await caller.run_async(target, statement, params)
    return ids


async def _first(pending: Coroutine[Any, Any, list[str]]) -> str:
    return (await pending)[0]


@overload
def enqueue_many(target: AsyncTarget, events: Iterable[Event], *, table: str = ...,
                 max_message_bytes: int = ...) -> Coroutine[Any, Any, list[str]]: ...


@overload
def enqueue_many(target: SyncTarget, events: Iterable[Event], *, table: str = ...,
                 max_message_bytes: int = ...) -> list[str]: ...


def enqueue_many(target: Any, events: Iterable[Event], *, table: str = "outbox",
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Any:
    """Add ``events`` to the outbox ``table`` in the caller's transaction, in one statement.

    Every event is checked before anything is written: the first bad one raises InvalidEvent
    with its ``index``. Returns the message ids, in the order given (a coroutine of them for
    an asynchronous target). Never commits.
    """
    kind = caller.kind_of(target)
    statement, params, ids = _prepare(events, table, max_message_bytes, single=False)
    if kind.is_async:
        return _run_async(target, statement, params, ids)
    if ids:
        caller.run(target, statement, params)
    return ids


@overload
def enqueue(target: AsyncTarget, *, exchange: str, routing_key: str, payload: Any,
            message_id: str | None = ..., ordering_key: str | None = ...,
            headers: Mapping[str, Any] | None = ..., content_type: str | None = ...,
            available_at: datetime | None = ..., table: str = ...,
            max_message_bytes: int = ...) -> Coroutine[Any, Any, str]: ...


@overload
def enqueue(target: SyncTarget, *, exchange: str, routing_key: str, payload: Any,
            message_id: str | None = ..., ordering_key: str | None = ...,
            headers: Mapping[str, Any] | None = ..., content_type: str | None = ...,
            available_at: datetime | None = ..., table: str = ...,
            max_message_bytes: int = ...) -> str: ...


def enqueue(target: Any, *, exchange: str, routing_key: str, payload: Any,
            message_id: str | None = None, ordering_key: str | None = None,
            headers: Mapping[str, Any] | None = None, content_type: str | None = None,
            available_at: datetime | None = None, table: str = "outbox",
            max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Any:
    """Add one event to the outbox ``table`` in the caller's transaction; its message id.

    ``payload``: bytes (bytearray, memoryview) are sent as they are (``payload_bytes``,
    application/octet-stream); anything else is serialized to JSON (``payload``, sent as its
    JSON text, application/json) — a ``str`` becomes a JSON string. ``message_id``: the dedup
    key, a new UUID when None. ``headers``: a JSON object, sent as AMQP headers.
    ``available_at``: a timezone-aware datetime before which the relay does not publish it.
    ``max_message_bytes``: the relay's OUTBOX_MAX_MESSAGE_BYTES. Raises InvalidEvent (naming
    the field) for what the relay would dead-letter, NotInTransaction on a connection that
    would commit the event on its own. Never commits.
    """
    event = Event(exchange=exchange, routing_key=routing_key, payload=payload,
                  message_id=message_id, ordering_key=ordering_key, headers=headers,
                  content_type=content_type, available_at=available_at)
    kind = caller.kind_of(target)
    statement, params, ids = _prepare([event], table, max_message_bytes, single=True)
    if kind.is_async:
        return _first(_run_async(target, statement, params, ids))
    caller.run(target, statement, params)
    return ids[0]


def schema_sql(table: str = "outbox") -> str:
    """The outbox schema (outbox and dead-letter tables, indexes) for ``table`` as plain SQL:
    idempotent, for an Alembic ``op.execute`` or a Django ``migrations.RunSQL``. The same text
    as ``outbox-relay migrate --print``."""
    _check_table(table)
    return schema.schema_sql(table)


__all__: Sequence[str] = ["DEFAULT_MAX_MESSAGE_BYTES", "Event", "enqueue", "enqueue_many",
                          "schema_sql"]
