"""The producer side: add events to the outbox inside the caller's own transaction.

``enqueue`` writes one event, ``enqueue_many`` any number in one statement (one round trip).
Both check every event against the relay's own rules first (outbox_relay.rules.publish_problem,
the function the relay dead-letters rows with) and raise InvalidEvent naming the field, so a bad
event fails in the producer, before anything is written and with the caller's transaction still
usable, instead of becoming a dead letter later. Neither commits: the event commits or rolls
back with the caller's own change. The targets they take are listed in outbox_relay.caller.

An asynchronous target (psycopg AsyncConnection or AsyncCursor, SQLAlchemy AsyncSession or
AsyncConnection) takes ``await enqueue_async(...)`` / ``await enqueue_many_async(...)``; the
synchronous names refuse it at once (TypeError), so a forgotten ``await`` cannot silently drop
an event that way, and one forgotten on the async names is flagged by type checkers and
reported when the coroutine is dropped (``Enqueueing``).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sys
import uuid
import warnings
from collections.abc import Callable, Coroutine, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, time
from decimal import Decimal
from enum import Enum
from functools import cache
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import psycopg

from outbox_relay import caller, schema, tracing
from outbox_relay.errors import ConfigError, InvalidEvent
from outbox_relay.rules import (
    DEFAULT_FRAME_MAX,
    DEFAULT_LEDGER_STREAM,
    DEFAULT_MAX_MESSAGE_BYTES,
    TRACEPARENT_HEADER,
    TRACESTATE_HEADER,
    available_at_problem,
    publish_problem,
    trace_context_problem,
)
from outbox_relay.sql import api_queries
from outbox_relay.tables import Tables, table_name

if TYPE_CHECKING:
    from sqlalchemy import Connection as SAConnection
    from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
    from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session
    from sqlalchemy.orm import Session, scoped_session

    from outbox_relay.testing import RecordingOutbox

    # What the API takes (outbox_relay.caller): a Django connection or cursor is a DBAPICursor or
    # is typed Any by Django itself. The test double is both.
    SyncTarget: TypeAlias = (psycopg.Connection[Any] | psycopg.Cursor[Any] | Session
                             | scoped_session[Any] | SAConnection | caller.DBAPICursor
                             | RecordingOutbox)
    AsyncTarget: TypeAlias = (psycopg.AsyncConnection[Any] | psycopg.AsyncCursor[Any]
                              | AsyncSession | async_scoped_session[Any] | SAAsyncConnection
                              | RecordingOutbox)

logger = logging.getLogger("outbox_relay")

# A JSON text holding a NUL character (\u0000 not preceded by an escaped backslash): jsonb
# refuses it.
_JSON_NUL_RE = re.compile(r"(?:^|[^\\])(?:\\\\)*\\u0000")

JsonDefault: TypeAlias = Callable[[Any], Any]
"""A ``json_default`` hook: given an object the built-in encoding does not handle, it returns
a JSON-serializable stand-in (which may hold the built-in types) or raises TypeError."""

_UNKNOWN = object()


def _builtin_json(value: object) -> object:
    """The stand-in of a value json does not encode, as DjangoJSONEncoder writes it (plain
    strings, readable in any language), or _UNKNOWN. Unlike Django, a datetime keeps its
    microseconds (Django cuts them to milliseconds for ECMA-262; every usual parser reads six
    digits, and an event's time is not rounded)."""
    if isinstance(value, datetime):
        text = value.isoformat()
        return text[:-6] + "Z" if text.endswith("+00:00") else text
    if isinstance(value, (date, time)):
        return value.isoformat()
    if isinstance(value, (Decimal, uuid.UUID)):
        return str(value)
    if isinstance(value, Enum):
        return value.value
    return _UNKNOWN


def _refuse(value: object) -> None:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable "
                    "(json_default= can encode it)")


def _builtin_default(value: object) -> object:
    found = _builtin_json(value)
    if found is _UNKNOWN:
        _refuse(value)
    return found


def _encoder(json_default: JsonDefault | None) -> json.JSONEncoder:
    """The JSON encoder of payloads and headers: the built-in types, then ``json_default``."""
    if json_default is None:
        return _ENCODER
    if not callable(json_default):
        raise TypeError(f"json_default must be callable, got {type(json_default).__name__}")
    hook = json_default

    def default(value: object) -> object:
        found = _builtin_json(value)
        return hook(value) if found is _UNKNOWN else found

    return json.JSONEncoder(ensure_ascii=False, allow_nan=False, default=default)


# jsonb refuses NaN and Infinity; text is kept as it is (PostgreSQL stores UTF-8).
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, default=_builtin_default)


@dataclass(frozen=True)
class Event:
    """One event for ``enqueue_many``; the fields are the arguments of ``enqueue``."""

    exchange: str
    routing_key: str
    payload: Any
    message_id: str | uuid.UUID | None = None
    ordering_key: str | None = None
    headers: Mapping[str, Any] | None = None
    content_type: str | None = None
    available_at: datetime | None = None
    message_type: str | None = None
    correlation_id: str | uuid.UUID | None = None


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
    message_type: str | None
    correlation_id: str | None
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


def _json(field: str, value: object, encoder: json.JSONEncoder) -> str:
    """``value`` as the JSON text PostgreSQL will store (jsonb refuses NaN, Infinity, \\u0000)."""
    try:
        text = encoder.encode(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidEvent(field, f"is not JSON-serializable: {exc}") from None
    # The regex costs about 12 us on a 150-byte text; the substring test, 0.1 us.
    if "\\u0000" in text and _JSON_NUL_RE.search(text):
        raise InvalidEvent(field, "contains a NUL character (\\u0000), which jsonb cannot hold")
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise InvalidEvent(field, f"holds text that is not valid UTF-8 ({exc.reason})") from None
    return text


def _headers(value: object, encoder: json.JSONEncoder,
             trace: Mapping[str, str] | None) -> tuple[dict[str, Any], str]:
    """The headers as the relay will read them back from jsonb, and their JSON text; with the
    current span's ``trace`` context, unless they carry a trace context of their own."""
    if value is None:
        if trace is None:
            return {}, "{}"
        value = {}
    if not isinstance(value, Mapping):
        raise InvalidEvent("headers", f"must be a mapping, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise InvalidEvent("headers", f"keys must be str, got {type(key).__name__}")
    own_trace = TRACEPARENT_HEADER in value or TRACESTATE_HEADER in value
    text = _json("headers", {**value, **trace} if trace and not own_trace else dict(value),
                 encoder)
    headers = json.loads(text)
    if own_trace and (bad := trace_context_problem(headers)) is not None:
        # The relay would publish the event without it: told here, where it was set.
        raise InvalidEvent("headers", f"{bad.reason}; the relay would drop it")
    return headers, text


def _row(event: Event, max_message_bytes: int, encoder: json.JSONEncoder,
         trace: Mapping[str, str] | None) -> _Row:
    exchange = _text("exchange", event.exchange)
    routing_key = _text("routing_key", event.routing_key)
    given_id = event.message_id
    if isinstance(given_id, uuid.UUID):
        given_id = str(given_id)
    message_id = _text("message_id", given_id, optional=True) or str(uuid.uuid4())
    ordering_key = _text("ordering_key", event.ordering_key, optional=True)
    content_type = _text("content_type", event.content_type, optional=True)
    message_type = _text("message_type", event.message_type, optional=True)
    given_correlation = event.correlation_id
    if isinstance(given_correlation, uuid.UUID):
        given_correlation = str(given_correlation)
    correlation_id = _text("correlation_id", given_correlation, optional=True)
    assert exchange is not None and routing_key is not None
    available_at = event.available_at
    if available_at is not None and (
            not isinstance(available_at, datetime) or available_at.utcoffset() is None):
        raise InvalidEvent("available_at", "must be a timezone-aware datetime or None "
                                           "(a naive one would be read in the session's TimeZone)")
    if available_at is not None and (never := available_at_problem(available_at)) is not None:
        raise InvalidEvent(never.field, never.reason)
    payload: str | None = None
    payload_bytes: bytes | None = None
    if isinstance(event.payload, (bytes, bytearray, memoryview)):
        payload_bytes = bytes(event.payload)
        body_size = len(payload_bytes)
    else:
        payload = _json("payload", event.payload, encoder)
        body_size = len(payload.encode())
    headers, headers_text = _headers(event.headers, encoder, trace)
    # The relay's checks with the relay's defaults for what the producer cannot see (the
    # broker's frame_max, OUTBOX_LEDGER_STREAM); created_at is now.
    found = publish_problem(
        message_id=message_id, exchange=exchange, routing_key=routing_key, body_size=body_size,
        headers=headers, ordering_key=ordering_key, content_type=content_type,
        json_payload=payload is not None, max_message_bytes=max_message_bytes,
        frame_max=DEFAULT_FRAME_MAX, ledger_stream=DEFAULT_LEDGER_STREAM, headers_text=headers_text,
        message_type=message_type, correlation_id=correlation_id)
    if found is not None:
        raise InvalidEvent(found.field, found.reason)
    return _Row(message_id, exchange, routing_key, ordering_key, payload, payload_bytes,
                headers_text, content_type, message_type, correlation_id, available_at)


def _prepare(events: Iterable[Event], table: str, max_message_bytes: int,
             json_default: JsonDefault | None, *,
             single: bool) -> tuple[caller.Statement, dict[str, list[Any]], list[str]]:
    statement = _statement(table)
    encoder = _encoder(json_default)
    # The caller's span, if any: every event carries its context (tracing.py).
    trace = tracing.trace_headers()
    rows: list[_Row] = []
    for index, event in enumerate(events):
        if not isinstance(event, Event):
            raise TypeError(f"event {index}: expected an outbox Event, got {type(event).__name__}")
        try:
            rows.append(_row(event, max_message_bytes, encoder, trace))
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


def _sync_kind(target: object, name: str) -> caller.Kind:
    kind = caller.kind_of(target)
    if kind.is_async:
        raise TypeError(f"{name}() got a {type(target).__name__}, which is asynchronous: use "
                        f"`await {name}_async(...)`")
    return kind


def _async_kind(target: object, name: str) -> caller.Kind:
    kind = caller.kind_of(target)
    if not kind.is_async and kind is not caller.Kind.RECORDING:
        raise TypeError(f"{name}_async() got a {type(target).__name__}, which is synchronous: "
                        f"call {name}(...), without await")
    return kind


def _insert(target: Any, kind: caller.Kind, table: str, statement: caller.Statement,
            params: dict[str, list[Any]]) -> None:
    if kind is caller.Kind.RECORDING:
        target._write(table, params)
    else:
        caller.run(target, statement, params)


async def _insert_async(target: Any, kind: caller.Kind, table: str,
                        statement: caller.Statement, params: dict[str, list[Any]],
                        ids: list[str]) -> list[str]:
    if ids and kind is caller.Kind.RECORDING:
        target._write(table, params)
    elif ids:
        await caller.run_async(target, statement, params)
    return ids


async def _insert_one_async(target: Any, kind: caller.Kind, table: str,
                            statement: caller.Statement, params: dict[str, list[Any]],
                            ids: list[str]) -> str:
    return (await _insert_async(target, kind, table, statement, params, ids))[0]


_T = TypeVar("_T")


class Enqueueing(Coroutine[Any, Any, _T]):
    """What ``enqueue_async`` and ``enqueue_many_async`` return: a coroutine that runs the
    INSERT when awaited (the events were checked by the call already).

    One that is never awaited writes nothing: the caller's transaction would commit its
    change without the event. It is reported at once (CPython destroys it at the end of the
    statement that dropped it, before the transaction can commit) with an ERROR log on the
    ``outbox_relay`` logger and a RuntimeWarning that name the events, the call's place and
    the fix. Type checkers flag the missing await before it runs: the functions are typed
    to return a ``Coroutine`` (mypy's ``unused-coroutine``, on by default; pyright's
    ``reportUnusedCoroutine`` reads the same type).
    """

    __slots__ = ("_closed", "_coro", "_ids", "_make", "_name", "_target", "_where")

    def __init__(self, make: Callable[[], Coroutine[Any, Any, _T]], *, target: object,
                 name: str, ids: list[str], where: tuple[str, int]) -> None:
        self._make: Callable[[], Coroutine[Any, Any, _T]] | None = make
        self._coro: Coroutine[Any, Any, _T] | None = None
        self._closed = False
        self._target: object = target
        self._name = name
        self._ids = ids
        self._where = where

    def _started(self) -> Coroutine[Any, Any, _T]:
        if self._coro is None:
            if self._make is None:
                raise RuntimeError("cannot await a closed coroutine")
            self._coro, self._make, self._target = self._make(), None, None
        return self._coro

    def __await__(self) -> Generator[Any, None, _T]:
        return self._started().__await__()

    def send(self, value: Any, /) -> Any:
        return self._started().send(value)

    def throw(self, typ: Any, val: Any = None, tb: TracebackType | None = None, /) -> Any:
        coro = self._started()
        if val is None and tb is None:
            return coro.throw(typ)
        return coro.throw(typ, val, tb)  # the old signature, for callers that still use it

    def close(self) -> None:
        """Close it without running it (on purpose: not reported)."""
        if self._coro is None:
            self._make = self._target = None
            self._closed = True
        else:
            self._coro.close()

    def __del__(self) -> None:
        if self._coro is None and not self._closed:
            _never_awaited(self._target, self._name, self._ids, self._where)


def _never_awaited(target: object, name: str, ids: list[str], where: tuple[str, int]) -> None:
    shown = ", ".join(ids[:3]) + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")
    message = (f"{name}() called at {where[0]}:{where[1]} was never awaited: {len(ids)} "
               f"event(s) NOT written to the outbox (message id {shown}); write "
               f"`await {name}(...)`")
    if caller.kind_of(target) is caller.Kind.RECORDING:
        target._never_awaited(message)  # type: ignore[attr-defined]  # its test fails
    logger.error(message)
    # Shown at the call's place, as Python's own warning for a coroutine never awaited.
    warnings.warn_explicit(message, RuntimeWarning, *where)


def _caller_place() -> tuple[str, int]:
    """Where the API was called from (the caller of enqueue_async), for the report."""
    frame = sys._getframe(2)
    return frame.f_code.co_filename, frame.f_lineno


def enqueue_many(target: SyncTarget, events: Iterable[Event], *, table: str = "outbox",
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 json_default: JsonDefault | None = None) -> list[str]:
    """Add ``events`` to the outbox ``table`` in the caller's transaction, in one statement.

    Every event is checked before anything is written: the first bad one raises InvalidEvent
    with its ``index``. ``json_default`` encodes what the built-in encoding does not, in every
    event (see ``enqueue``). Returns the message ids, in the order given. Never commits. An
    asynchronous target is refused (TypeError): use ``await enqueue_many_async(...)``.
    """
    kind = _sync_kind(target, "enqueue_many")
    statement, params, ids = _prepare(events, table, max_message_bytes, json_default,
                                      single=False)
    if ids:
        _insert(target, kind, table, statement, params)
    return ids


def enqueue_many_async(target: AsyncTarget, events: Iterable[Event], *, table: str = "outbox",
                       max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                       json_default: JsonDefault | None = None
                       ) -> Coroutine[Any, Any, list[str]]:
    """``enqueue_many`` on an asynchronous target: ``await enqueue_many_async(conn, events)``.

    The events are checked by the call (InvalidEvent is raised before any await); the INSERT
    runs when the result is awaited. Never awaited, nothing is written: see ``Enqueueing``.
    """
    kind = _async_kind(target, "enqueue_many")
    statement, params, ids = _prepare(events, table, max_message_bytes, json_default,
                                      single=False)
    return Enqueueing(functools.partial(_insert_async, target, kind, table, statement, params,
                                        ids),
                      target=target, name="enqueue_many_async", ids=ids, where=_caller_place())


def enqueue(target: SyncTarget, *, exchange: str, routing_key: str, payload: Any,
            message_id: str | uuid.UUID | None = None, ordering_key: str | None = None,
            headers: Mapping[str, Any] | None = None, content_type: str | None = None,
            available_at: datetime | None = None, message_type: str | None = None,
            correlation_id: str | uuid.UUID | None = None, table: str = "outbox",
            max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
            json_default: JsonDefault | None = None) -> str:
    """Add one event to the outbox ``table`` in the caller's transaction; its message id.

    ``payload``: bytes (bytearray, memoryview) are sent as they are (``payload_bytes``,
    application/octet-stream); anything else is serialized to JSON (``payload``, sent as its
    JSON text, application/json) — a ``str`` becomes a JSON string. Beyond what json encodes,
    a datetime is written in ISO 8601 (``Z`` for UTC, microseconds kept), a date or time in
    ISO 8601, a Decimal or UUID as its string, an Enum as its value; ``json_default`` is
    called with anything else (a pydantic model, a dataclass) and returns a JSON-serializable
    stand-in. ``message_id``: the dedup key (a str, or a UUID written as its string), a new
    UUID when None. ``headers``: a JSON object (encoded as the payload), sent as AMQP headers;
    inside an OpenTelemetry span, the span's context is added as ``traceparent`` and
    ``tracestate`` unless ``headers`` has either (a malformed one raises InvalidEvent).
    ``available_at``: a timezone-aware datetime before which the relay does not publish it.
    ``message_type`` and ``correlation_id`` (a str, or a UUID written as its string): the
    message's AMQP ``type`` and ``correlation_id`` properties, unset when None (at most 255
    bytes of UTF-8, no control characters). ``max_message_bytes``: the relay's
    OUTBOX_MAX_MESSAGE_BYTES. Raises InvalidEvent (naming the field) for what the relay would
    dead-letter, NotInTransaction on a connection that would commit the event on its own,
    TypeError for an asynchronous target (use ``await enqueue_async(...)``). Never commits.
    """
    kind = _sync_kind(target, "enqueue")
    event = Event(exchange=exchange, routing_key=routing_key, payload=payload,
                  message_id=message_id, ordering_key=ordering_key, headers=headers,
                  content_type=content_type, available_at=available_at,
                  message_type=message_type, correlation_id=correlation_id)
    statement, params, ids = _prepare([event], table, max_message_bytes, json_default,
                                      single=True)
    _insert(target, kind, table, statement, params)
    return ids[0]


def enqueue_async(target: AsyncTarget, *, exchange: str, routing_key: str, payload: Any,
                  message_id: str | uuid.UUID | None = None, ordering_key: str | None = None,
                  headers: Mapping[str, Any] | None = None, content_type: str | None = None,
                  available_at: datetime | None = None, message_type: str | None = None,
                  correlation_id: str | uuid.UUID | None = None, table: str = "outbox",
                  max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                  json_default: JsonDefault | None = None) -> Coroutine[Any, Any, str]:
    """``enqueue`` on an asynchronous target (psycopg AsyncConnection or AsyncCursor,
    SQLAlchemy AsyncSession or AsyncConnection): ``await enqueue_async(conn, ...)``.

    The event is checked by the call (InvalidEvent is raised before any await); the INSERT
    runs when the result is awaited. Never awaited, nothing is written: see ``Enqueueing``.
    """
    kind = _async_kind(target, "enqueue")
    event = Event(exchange=exchange, routing_key=routing_key, payload=payload,
                  message_id=message_id, ordering_key=ordering_key, headers=headers,
                  content_type=content_type, available_at=available_at,
                  message_type=message_type, correlation_id=correlation_id)
    statement, params, ids = _prepare([event], table, max_message_bytes, json_default,
                                      single=True)
    return Enqueueing(functools.partial(_insert_one_async, target, kind, table, statement,
                                        params, ids),
                      target=target, name="enqueue_async", ids=ids, where=_caller_place())


def schema_sql(table: str = "outbox") -> str:
    """The outbox schema (outbox and dead-letter tables, indexes) for ``table`` as plain SQL:
    idempotent, for an Alembic ``op.execute`` or a Django ``migrations.RunSQL``. The same text
    as ``outbox-relay migrate --print``."""
    _check_table(table)
    return schema.schema_sql(table)


__all__: Sequence[str] = ["DEFAULT_MAX_MESSAGE_BYTES", "Enqueueing", "Event", "JsonDefault",
                          "enqueue", "enqueue_async", "enqueue_many", "enqueue_many_async",
                          "schema_sql"]
