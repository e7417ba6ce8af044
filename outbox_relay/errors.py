"""The relay's error hierarchy: every error the programs report on purpose is one of these."""

from __future__ import annotations


class OutboxError(Exception):
    """Base class of every error raised on purpose by outbox-relay."""


class ConfigError(OutboxError):
    """A setting has a value the programs cannot use."""


class StartupCheckError(OutboxError):
    """A server is reachable but not fit to run the protocol (2PC off, schema missing...)."""


class TransientError(OutboxError):
    """A connection-level fault: reconnect with backoff and try again."""


class StandbyWaitTimeout(TransientError):
    """OUTBOX_STANDBY_WAIT: the standby did not flush past a batch's claim in time; the batch
    was rolled back before anything was published."""


class DatabaseError(OutboxError):
    """PostgreSQL refused a statement (the store translates the driver's errors into these);
    ``sqlstate`` is its SQLSTATE, None when the client raised it."""

    def __init__(self, message: str, *, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class DatabaseUnavailable(DatabaseError):
    """The server could not serve the statement (out of resources, shutting down, the session
    gone: psycopg's OperationalError and InterfaceError), as opposed to refusing it."""


class ConnectionLost(DatabaseUnavailable):
    """The PostgreSQL session is gone (client-side error, class 08 or 57P): reconnect."""


class BatchFailed(OutboxError):
    """The broker did not confirm every message of a batch; it must be rolled back."""


class InvalidEvent(OutboxError, ValueError):
    """An event the relay could never publish (or PostgreSQL could not store), refused by the
    producer API before its INSERT: ``field`` names the argument at fault, ``reason`` says why
    (for a relay rule, the reason the relay would dead-letter the row with), ``index`` is the
    event's position in a batch (None for a single event)."""

    def __init__(self, field: str, reason: str, *, index: int | None = None) -> None:
        self.field = field
        self.reason = reason
        self.index = index
        where = "" if index is None else f"event {index}: "
        super().__init__(f"{where}{field}: {reason}")


class NotInTransaction(OutboxError):
    """The caller's connection has no transaction open and commits every statement by itself:
    an event written there would not commit or roll back with the caller's own change."""


class InboxError(OutboxError):
    """The inbox was used in a way that cannot keep its promise (see the message)."""


class LedgerMissing(BatchFailed):
    """The ledger stream or its exchange is gone (deleted while we ran): declare it again
    before claiming anything, or batches would be published with no ledger behind them."""


def first_line(text: str) -> str:
    """The first line of ``text`` without surrounding blanks ("" for blank text): error texts
    of libpq and pika run over several lines, logs and probe bodies want one."""
    return (text.strip().splitlines() or [""])[0]


def describe(exc: BaseException) -> str:
    """One line naming ``exc``: its text's first line, or its class when it has no text."""
    return first_line(str(exc)) or type(exc).__name__
