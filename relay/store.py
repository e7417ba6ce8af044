"""The outbox in PostgreSQL: claim, prepare, finish, record failures. Steps 1, 2 and 5.

Two autocommit sessions. The claim session runs the claim transaction, opened with an explicit
BEGIN and ended by PREPARE TRANSACTION. The main session holds the relay's instance lock and
runs COMMIT/ROLLBACK PREPARED (which must run outside any transaction block), the failure
bookkeeping and the stats: so the next batch can be claimed while this one is still being
confirmed, and this one committed while the next claim is open.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import psycopg.conninfo
import psycopg.errors
from psycopg import sql
from psycopg.types.json import Jsonb

from relay.errors import StartupCheckError, TransientError, describe
from relay.queries import Tables

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutboxRow:
    """A claimed outbox row."""

    id: int
    message_id: str
    exchange: str
    routing_key: str
    ordering_key: str | None
    payload: str | None  # JSON text
    payload_bytes: bytes | None
    headers: Any
    content_type: str | None
    created_at: datetime
    attempts: int
    last_error: str | None


@dataclass(frozen=True)
class PreparedXact:
    gid: str
    prepared: datetime
    owner: str
    age_seconds: float


# libpq's TCP settings unless the URL sets them: a silent partition is noticed in about 30 s,
# not after the kernel's retransmission limit (about 15 minutes).
TCP_DEFAULTS = {"keepalives": "1", "keepalives_idle": "10", "keepalives_interval": "5",
                "keepalives_count": "3", "tcp_user_timeout": "30000"}


def connection_options(url: str) -> dict[str, str]:
    """TCP_DEFAULTS that ``url`` does not set itself (a unix socket needs none)."""
    given = psycopg.conninfo.conninfo_to_dict(url)
    if str(given.get("host", "")).startswith("/"):
        return {}
    return {k: v for k, v in TCP_DEFAULTS.items() if k not in given}


def connect(url: str, *, timeout: float, application_name: str) -> psycopg.Connection[Any]:
    """An autocommit connection; a failure is a TransientError that never shows the password."""
    try:
        return psycopg.connect(
            psycopg.conninfo.make_conninfo(url, **connection_options(url)), autocommit=True,
            connect_timeout=max(1, round(timeout)), application_name=application_name,
        )
    except psycopg.OperationalError as exc:
        # libpq's message names host and port, never the password.
        raise TransientError(f"cannot connect to PostgreSQL: {describe(exc)}") from exc


def _usable(conn: psycopg.Connection[Any] | None) -> psycopg.Connection[Any]:
    if conn is None or conn.closed:
        raise TransientError("not connected to PostgreSQL")
    return conn


def is_connection_error(exc: BaseException) -> bool:
    """True for errors that mean the session is gone (retry on a new connection).

    psycopg raises OperationalError for more than that (class 53, e.g. "maximum number of
    prepared transactions reached"): those come with a SQLSTATE from a live session.
    """
    if not isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
        return False
    sqlstate = getattr(exc, "sqlstate", None)
    # None: raised by the client (socket gone); 08: connection exception; 57P: server shutdown.
    return sqlstate is None or sqlstate.startswith(("08", "57P"))


def check_server(conn: psycopg.Connection[Any], tables: Tables | None = None) -> None:
    """Fail fast with one clear line when 2PC is off or (given ``tables``) the schema is missing."""
    names = tables or Tables("outbox")
    # to_regclass parses its argument as SQL: pass the quoted identifiers, not the bare names,
    # or a mixed-case table would be folded to lower case and not found.
    row = conn.execute(names.query("server_check"), {
        "outbox": names.outbox.as_string(None), "dead_letter": names.dead_letter.as_string(None),
    }).fetchone()
    assert row is not None
    max_prepared, has_outbox, has_dead_letter, version = row
    if max_prepared <= 0:
        raise StartupCheckError(
            "PostgreSQL has max_prepared_transactions = 0, so PREPARE TRANSACTION fails: set it "
            "(e.g. to max_connections) in postgresql.conf and restart the server"
        )
    if version < 130000:
        raise StartupCheckError("PostgreSQL 13 or newer is required")
    if tables is not None and not (has_outbox and has_dead_letter):
        raise missing_schema(tables)


def missing_schema(tables: Tables) -> StartupCheckError:
    """The one-line error for an outbox or dead-letter table that does not exist."""
    return StartupCheckError(f"table {tables.name!r} or {tables.dead_letter_name!r} does not "
                             "exist: run `outbox-relay migrate` first")


def prepared_of_prefix(conn: psycopg.Connection[Any], prefix: str) -> list[PreparedXact]:
    rows = conn.execute(Tables("outbox").query("prepared_of_prefix"), {"prefix": prefix + ":"})
    return [PreparedXact(*row) for row in rows]


@dataclass(frozen=True)
class SessionRole:
    name: str
    superuser: bool

    def may_finish(self, owner: str) -> bool:
        """COMMIT/ROLLBACK PREPARED is allowed to the preparing role or a superuser only."""
        return self.superuser or owner == self.name


def session_role(conn: psycopg.Connection[Any]) -> SessionRole:
    row = conn.execute(Tables("outbox").query("session_role")).fetchone()
    assert row is not None
    return SessionRole(row[0], bool(row[1]))


@dataclass(frozen=True)
class HorizonHolder:
    """The oldest transaction id one kind of holder keeps alive (see the ``xmin_horizon`` query)."""

    xid_age: int
    age_seconds: float | None  # prepared transactions only


def xmin_horizon(conn: psycopg.Connection[Any], prefix: str) -> dict[str, HorizonHolder]:
    """{holder kind: its oldest xid}; kinds: outbox_prepared (this gid prefix), other_prepared,
    session, replication_slot. Kinds holding nothing are left out."""
    rows = conn.execute(Tables("outbox").query("xmin_horizon"), {"prefix": prefix + ":"})
    return {holder: HorizonHolder(int(xid_age), age_seconds)
            for holder, xid_age, age_seconds in rows}


def finish_prepared(conn: psycopg.Connection[Any], gid: str, *, commit: bool) -> bool:
    """COMMIT or ROLLBACK PREPARED; False when the transaction no longer exists (42704).

    A gid cannot be a bind parameter: it is composed as a quoted literal, and only gids of our
    own format (checked by the caller) ever get here.
    """
    verb = sql.SQL("COMMIT PREPARED {}" if commit else "ROLLBACK PREPARED {}")
    try:
        conn.execute(verb.format(sql.Literal(gid)))
    except psycopg.errors.UndefinedObject:
        return False
    return True


def try_instance_lock(conn: psycopg.Connection[Any], lock_class: int, instance: int) -> bool:
    row = conn.execute(
        Tables("outbox").query("try_instance_lock"), {"class": lock_class, "instance": instance}
    ).fetchone()
    return bool(row and row[0])


def instance_unlock(conn: psycopg.Connection[Any], lock_class: int, instance: int) -> None:
    conn.execute(Tables("outbox").query("instance_unlock"), {"class": lock_class, "instance": instance})


class OutboxStore:
    """The relay's view of the outbox on one session-mode connection."""

    def __init__(self, url: str, table: str, *, connect_timeout: float = 10.0,
                 application_name: str = "outbox-relay") -> None:
        self._url = url
        self._connect_timeout = connect_timeout
        self._application_name = application_name
        self.tables = Tables(table)
        self._conn: psycopg.Connection[Any] | None = None
        self._claim_conn: psycopg.Connection[Any] | None = None
        self._claim = self.tables.query("claim")

    @property
    def conn(self) -> psycopg.Connection[Any]:
        """The main session: instance lock, COMMIT/ROLLBACK PREPARED, failures, stats."""
        return _usable(self._conn)

    @property
    def claim_conn(self) -> psycopg.Connection[Any]:
        """The claim session: BEGIN, claim, dead-letter invalid rows, PREPARE TRANSACTION."""
        return _usable(self._claim_conn)

    @property
    def connected(self) -> bool:
        return all(c is not None and not c.closed and not c.broken
                   for c in (self._conn, self._claim_conn))

    def connect(self, lock_class: int, instance: int) -> None:
        """Connect, check the server and schema, and take this relay's instance lock."""
        self.close()
        self._conn = connect(self._url, timeout=self._connect_timeout,
                             application_name=self._application_name)
        check_server(self._conn, self.tables)
        # The lock lives as long as this session: the resolver takes it to learn we are gone.
        if not try_instance_lock(self._conn, lock_class, instance):
            self.close()
            raise TransientError("instance lock busy (a resolver is checking it); retrying")
        try:
            self._claim_conn = connect(self._url, timeout=self._connect_timeout,
                                       application_name=f"{self._application_name} claim")
        except TransientError:
            self.close()
            raise

    def close(self) -> None:
        for conn in (self._claim_conn, self._conn):
            if conn is not None and not conn.closed:
                conn.close()
        self._conn = self._claim_conn = None

    def reset(self) -> None:
        """Roll back an open (unprepared) transaction; close the sessions if even that fails."""
        for conn in (self._claim_conn, self._conn):
            if conn is None or conn.closed:
                continue
            try:
                if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    conn.execute("ROLLBACK")
            except psycopg.Error:
                self.close()
                return

    def claim(self, limit: int) -> list[OutboxRow]:
        """Step 1: BEGIN, then lock and delete up to ``limit`` due rows (SKIP LOCKED)."""
        conn = self.claim_conn
        conn.execute("BEGIN")
        cur = conn.execute(self._claim, {"limit": limit})
        # RETURNING follows the executor, not ORDER BY: publish in insert order.
        return sorted((OutboxRow(*row) for row in cur.fetchall()), key=lambda r: r.id)

    def dead_letter_claimed(self, rows: Sequence[tuple[OutboxRow, str]]) -> None:
        """Inside the claim transaction: rows that can never be published go to dead letter."""
        params = [
            {"id": r.id, "message_id": r.message_id, "exchange": r.exchange,
             "routing_key": r.routing_key, "ordering_key": r.ordering_key, "payload": r.payload,
             "payload_bytes": r.payload_bytes, "headers": Jsonb(r.headers),
             "content_type": r.content_type, "created_at": r.created_at,
             "attempts": r.attempts, "error": error}
            for r, error in rows
        ]
        with self.claim_conn.cursor() as cur:
            cur.executemany(self.tables.query("dead_letter_claimed"), params)

    def rollback(self) -> None:
        """End a claim that found nothing (or is abandoned) without preparing it."""
        self.claim_conn.execute("ROLLBACK")

    def prepare(self, gid: str) -> None:
        """Step 2: PREPARE TRANSACTION; checks that it really prepared."""
        cur = self.claim_conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        # A transaction that already failed answers "ROLLBACK" without an error.
        if cur.statusmessage != "PREPARE TRANSACTION":
            raise TransientError(f"PREPARE TRANSACTION answered {cur.statusmessage!r}")

    def finish(self, gid: str, *, commit: bool) -> bool:
        """Step 5 (or the failure path): False if someone else already finished it."""
        return finish_prepared(self.conn, gid, commit=commit)

    def settle_failed(
        self,
        delivered: Sequence[int],
        failures: Mapping[int, str],
        attributed: Sequence[int],
        *,
        max_attempts: int,
        base_delay: float,
        max_delay: float,
    ) -> list[int]:
        """After ROLLBACK PREPARED: drop delivered rows, count failures, dead-letter the exhausted.

        Only rows whose failure was their own (``attributed``) can run out of attempts; a row
        that merely shared a batch with the culprit is retried alone instead.
        Returns the ids moved to the dead-letter table.
        """
        conn = self.conn
        with conn.transaction():
            if delivered:
                conn.execute(self.tables.query("forget_delivered"), {"ids": list(delivered)})
            if failures:
                conn.execute(
                    self.tables.query("record_failures"),
                    {"ids": list(failures), "errors": list(failures.values()),
                     "base_delay": base_delay, "max_delay": max_delay},
                )
            if not attributed:
                return []
            cur = conn.execute(self.tables.query("dead_letter_exhausted"),
                               {"ids": list(attributed), "max_attempts": max_attempts})
            return [row[0] for row in cur.fetchall()]

    def stats(self) -> tuple[int, float]:
        """(backlog rows, lag seconds) for the metrics."""
        row = self.conn.execute(self.tables.query("stats")).fetchone()
        assert row is not None
        return int(row[0]), float(row[1])

    def prepared(self, prefix: str) -> list[PreparedXact]:
        return prepared_of_prefix(self.conn, prefix)
