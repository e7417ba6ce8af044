"""Run one statement on the caller's own connection, inside the caller's own transaction.

What the producer API (outbox_relay.producer) and the inbox (outbox_relay.inbox) are given is whatever the
service already holds: a psycopg 3 connection or cursor (sync or async), a SQLAlchemy Session
or Connection (sync or async, any PostgreSQL driver), a Django connection or cursor, or any
DB-API cursor of a PostgreSQL driver with the ``pyformat`` paramstyle (psycopg2). Nothing here
commits, rolls back or opens a transaction; a target that would commit the statement on its
own (autocommit, outside a transaction block) is refused with NotInTransaction where that can
be told. The test double outbox_relay.testing.RecordingOutbox is recognised too (Kind.RECORDING):
the producer API records events in it instead of running its statement.

SQLAlchemy and Django are never imported here: a target is recognised through the modules the
service has already imported, so neither is a dependency of the relay's image.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any, Protocol

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from outbox_relay.errors import NotInTransaction


class DBAPICursor(Protocol):
    """A DB-API 2 cursor of a PostgreSQL driver with the ``pyformat`` paramstyle. (``fetchall``
    returns rows, not a coroutine: an asynchronous cursor is no DBAPICursor to a type checker.)"""

    def execute(self, query: Any, params: Any = ..., /) -> object: ...

    def fetchall(self) -> Sequence[Any]: ...


class Kind(Enum):
    PSYCOPG = "psycopg"
    PSYCOPG_ASYNC = "psycopg async"
    SQLALCHEMY = "sqlalchemy"
    SQLALCHEMY_ASYNC = "sqlalchemy async"
    DJANGO_CONNECTION = "django connection"
    DJANGO_CURSOR = "django cursor"
    DBAPI = "dbapi"
    # outbox_relay.testing.RecordingOutbox: runs no SQL; the producer API records events in it,
    # sync or async.
    RECORDING = "recording outbox"

    @property
    def is_async(self) -> bool:
        return self in (Kind.PSYCOPG_ASYNC, Kind.SQLALCHEMY_ASYNC)


_PARAM_RE = re.compile(r"%\((\w+)\)s")


class Statement:
    """One statement with ``%(name)s`` parameters, its identifiers composed with psycopg.sql.

    Identifiers reaching here passed config.table_name (letters, digits, ``_``), so the text
    holds no ``%`` or ``:`` of its own and converts safely to SQLAlchemy's ``:name`` style.
    Casts are written ``CAST(x AS type)``: ``::type`` after a ``:name`` confuses SQLAlchemy.
    """

    def __init__(self, composed: sql.Composed) -> None:
        self.composed = composed
        self.text = composed.as_string(None)
        self.sqlalchemy_text = _PARAM_RE.sub(r":\1", self.text).replace("%%", "%")


def _module(name: str) -> Any:
    return sys.modules.get(name)


def _isinstance(target: object, module: str, *names: str) -> bool:
    mod = _module(module)
    if mod is None:
        return False
    classes = tuple(c for c in (getattr(mod, n, None) for n in names) if isinstance(c, type))
    return bool(classes) and isinstance(target, classes)


def kind_of(target: object) -> Kind:
    """Which kind of connection ``target`` is; TypeError for anything that runs no SQL."""
    if isinstance(target, (psycopg.Connection, psycopg.Cursor)):
        return Kind.PSYCOPG
    if isinstance(target, (psycopg.AsyncConnection, psycopg.AsyncCursor)):
        return Kind.PSYCOPG_ASYNC
    if _isinstance(target, "outbox_relay.testing", "RecordingOutbox"):
        return Kind.RECORDING
    if _isinstance(target, "sqlalchemy.ext.asyncio", "AsyncSession", "AsyncConnection",
                   "async_scoped_session"):
        return Kind.SQLALCHEMY_ASYNC
    if (_isinstance(target, "sqlalchemy.orm", "Session", "scoped_session")
            or _isinstance(target, "sqlalchemy.engine", "Connection")):
        return Kind.SQLALCHEMY
    # django.db.connection is a proxy to the default DatabaseWrapper: recognised by its API.
    if hasattr(target, "in_atomic_block") and callable(getattr(target, "cursor", None)):
        return Kind.DJANGO_CONNECTION
    if hasattr(getattr(target, "db", None), "in_atomic_block") and hasattr(target, "execute"):
        return Kind.DJANGO_CURSOR
    if callable(getattr(target, "execute", None)) and callable(getattr(target, "fetchall", None)):
        return Kind.DBAPI
    raise TypeError(
        f"expected a psycopg connection or cursor, a SQLAlchemy Session or Connection, a Django "
        f"connection or cursor, or a DB-API cursor; got {type(target).__name__}")


_AUTOCOMMIT_HINT = (
    "{what} is in autocommit mode outside a transaction: the event would be committed on its "
    "own, not with your change. {fix}")


def _check_psycopg(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        raise NotInTransaction(_AUTOCOMMIT_HINT.format(
            what="the psycopg connection",
            fix="Call it inside `with conn.transaction():` (or `async with`)."))


def _check_django(connection: Any) -> None:
    if not connection.in_atomic_block:
        raise NotInTransaction(_AUTOCOMMIT_HINT.format(
            what="the Django connection", fix="Call it inside `with transaction.atomic():`."))


def _tuple(row: Any) -> tuple[Any, ...]:
    # A dict-like row (psycopg2's RealDictCursor, a Django dict cursor): its values, in order.
    return tuple(row.values()) if isinstance(row, Mapping) else tuple(row)


def _rows(cursor: Any) -> list[tuple[Any, ...]]:
    return [_tuple(r) for r in cursor.fetchall()] if cursor.description is not None else []


def run(target: Any, statement: Statement, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
    """Execute ``statement`` on a synchronous ``target``; the rows it returns, if any."""
    kind = kind_of(target)
    if kind is Kind.PSYCOPG:
        conn = target if isinstance(target, psycopg.Connection) else target.connection
        _check_psycopg(conn)
        # A cursor of our own: the caller's cursor keeps its pending results.
        with conn.cursor(row_factory=tuple_row) as cur:
            cur.execute(statement.composed, params)
            return _rows(cur)
    if kind is Kind.SQLALCHEMY:
        from sqlalchemy import text  # the target is a SQLAlchemy object: it is installed

        result = target.execute(text(statement.sqlalchemy_text), dict(params))
        return [_tuple(r) for r in result] if result.returns_rows else []
    if kind is Kind.DJANGO_CONNECTION:
        _check_django(target)
        with target.cursor() as cur:
            cur.execute(statement.text, params)
            return _rows(cur)
    if kind is Kind.DJANGO_CURSOR:
        _check_django(target.db)
    if kind in (Kind.DJANGO_CURSOR, Kind.DBAPI):
        target.execute(statement.text, params)
        return _rows(target)
    if kind is Kind.RECORDING:
        raise TypeError(_RECORDS_EVENTS_ONLY)
    raise TypeError(f"{type(target).__name__} is asynchronous: await the call")


async def run_async(target: Any, statement: Statement,
                    params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
    """Execute ``statement`` on an asynchronous ``target``; the rows it returns, if any."""
    kind = kind_of(target)
    if kind is Kind.PSYCOPG_ASYNC:
        conn = target if isinstance(target, psycopg.AsyncConnection) else target.connection
        _check_psycopg(conn)
        async with conn.cursor(row_factory=tuple_row) as acur:
            await acur.execute(statement.composed, params)
            return list(await acur.fetchall()) if acur.description is not None else []
    if kind is Kind.SQLALCHEMY_ASYNC:
        from sqlalchemy import text

        result = await target.execute(text(statement.sqlalchemy_text), dict(params))
        return [_tuple(r) for r in result] if result.returns_rows else []
    if kind is Kind.RECORDING:
        raise TypeError(_RECORDS_EVENTS_ONLY)
    raise TypeError(f"{type(target).__name__} is synchronous: call it without await")


_RECORDS_EVENTS_ONLY = ("a RecordingOutbox records what enqueue and enqueue_many write; it runs "
                        "no other SQL")
