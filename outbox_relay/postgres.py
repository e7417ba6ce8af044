"""PostgreSQL plumbing both programs run on: connecting, the driver's errors translated at the
stores' edge, the start-up checks, the ledger key, and the statements of the two-phase protocol
that both finish (COMMIT/ROLLBACK PREPARED, the instance advisory lock).

The programs' stores (outbox_relay.relay.store, outbox_relay.resolver.store) are built on these;
no psycopg error gets past them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar

import psycopg
import psycopg.conninfo
import psycopg.errors
from psycopg import sql

from outbox_relay.errors import (
    ConnectionLost,
    DatabaseError,
    DatabaseUnavailable,
    StartupCheckError,
    TransientError,
    describe,
)
from outbox_relay.model import OutboxStats
from outbox_relay.tables import Tables

log = logging.getLogger(__name__)

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


def pin_search_path(conn: psycopg.Connection[Any], table: str) -> Tables:
    """Pin the session's search_path to ``pg_catalog, pg_temp``; returns ``table``'s Tables
    with the schema it names or was found in under the session's own path (before the pin).

    PostgreSQL picks the best match for a function or operator among every schema on the
    path, not the first one that has the name: with the default path, a producer's
    public.mod(numeric, bigint) beats pg_catalog's mod(numeric, numeric) in the claim and runs
    as the relay's role (public is writable by every role on PostgreSQL 13 and 14). Pinned,
    only pg_catalog's are ever found, whoever may create in the outbox's schema. (Pinned to
    ``pg_catalog, <the outbox's schema>`` instead, a look-alike operator there would still beat
    a cast: the claim's byte budget compares numeric with integer.) A SET at connect rather
    than libpq's ``options``: PgBouncer refuses that parameter or drops it, and the URL may
    carry options of its own (their search_path is the one the table is looked up in).
    """
    given = Tables(table)
    schema = given.schema_name
    if schema is None:
        row = conn.execute(given.query("outbox_schema"),
                           {"outbox": given.outbox.as_string(None)}).fetchone()
        schema = row[0] if row else None
        if schema is None:
            raise StartupCheckError(
                f"table {table!r} is not on the search_path and there is no schema to create "
                "it in: name its schema in OUTBOX_TABLE (schema.table)")
    conn.execute(given.query("pin_search_path"))
    return Tables(table, schema=schema)


def connect_pinned(url: str, table: str, *, timeout: float,
                   application_name: str) -> tuple[psycopg.Connection[Any], Tables]:
    """``connect``, then ``pin_search_path``: every session of the relay and the resolver."""
    conn = connect(url, timeout=timeout, application_name=application_name)
    try:
        return conn, pin_search_path(conn, table)
    except BaseException:
        conn.close()
        raise


def check_create(conn: psycopg.Connection[Any], tables: Tables) -> list[str]:
    """Refuse to run when anyone but a superuser may create in pg_catalog, the only schema the
    pinned search_path looks in; returns a warning when PUBLIC or another role may create in
    the outbox's schema (the programs never look there for a function, but the producers',
    the services' and psql sessions do, with the default search_path)."""
    rows = conn.execute(tables.query("create_check"), {
        "outbox": tables.outbox.as_string(None), "schema": tables.schema_name or "pg_catalog",
    }).fetchall()
    warnings = []
    for schema, public_create, roles in rows:
        who = "PUBLIC" if public_create else _some(roles)
        if not who:
            continue
        revoke = (f"REVOKE CREATE ON SCHEMA {sql.Identifier(schema).as_string(None)} FROM "
                  + ("PUBLIC" if public_create else ", ".join(
                      sql.Identifier(role).as_string(None) for role in roles)))
        if schema == "pg_catalog":
            raise StartupCheckError(
                f"{who} may CREATE in schema pg_catalog, where this program looks up every "
                f"function: what they create there would run as its role; {revoke}")
        warnings.append(
            f"{who} may CREATE in schema {schema!r}, the outbox's: a function or operator "
            "created there runs as whoever has the schema on their search_path (the default "
            "path has public); the relay and the resolver pin theirs to pg_catalog, your "
            f"services and psql do not: {revoke}" + (" (sql/roles.sql does)" if public_create
                                                      and schema == "public" else ""))
    return warnings


def _some(names: list[str], shown: int = 5) -> str:
    """``a, b and 3 more roles`` (empty for no names)."""
    if not names:
        return ""
    listed = ", ".join(names[:shown])
    rest = len(names) - shown
    noun = "role" if len(names) == 1 else "roles"
    return f"{noun} {listed}" + (f" and {rest} more" if rest > 0 else "")


def warn_create(warnings: list[str]) -> None:
    for warning in warnings:
        log.warning("%s", warning, extra={"action": "schema_create_open"})


def usable(conn: psycopg.Connection[Any] | None) -> psycopg.Connection[Any]:
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


def translate(exc: psycopg.Error) -> DatabaseError:
    """The driver's error as the relay's: ConnectionLost when the session is gone,
    DatabaseUnavailable when the server could not serve the statement."""
    kind: type[DatabaseError] = DatabaseError
    if is_connection_error(exc):
        kind = ConnectionLost
    elif isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
        kind = DatabaseUnavailable
    return kind(str(exc), sqlstate=getattr(exc, "sqlstate", None))

P = ParamSpec("P")
R = TypeVar("R")


def translated(method: Callable[P, R]) -> Callable[P, R]:
    """The store's edge: no psycopg error gets past it (the relay loop imports no driver)."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except psycopg.Error as exc:
            raise translate(exc) from exc

    return wrapper


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
            "(e.g. to max_connections) in postgresql.conf, or a managed service's parameter "
            "group or flags, and restart the server"
        )
    if version < 130000:
        raise StartupCheckError("PostgreSQL 13 or newer is required")
    if tables is not None and not (has_outbox and has_dead_letter):
        raise missing_schema(tables)


def other_hosts(url: str, conn: psycopg.Connection[Any]) -> list[tuple[str, int]]:
    """The hosts of a libpq multi-host ``url`` besides the one ``conn`` is on (libpq's rules:
    one port for every host when one is given, 5432 when none)."""
    params = psycopg.conninfo.conninfo_to_dict(url)
    hosts = str(params.get("host") or "").split(",")
    if len(hosts) < 2:
        return []
    ports = str(params.get("port") or "").split(",")
    if len(ports) == 1:
        ports = ports * len(hosts)
    pairs = [(host, int(port or 5432)) for host, port in zip(hosts, ports, strict=False)]
    return [pair for pair in pairs if pair != (conn.info.host, conn.info.port)]


def check_standbys(url: str, conn: psycopg.Connection[Any], timeout: float) -> list[str]:
    """Refuse a standby of ``url`` whose max_prepared_transactions is below the primary's
    (``conn``'s): PostgreSQL pauses its replay, and promoted it could not hold the relays'
    prepared batches. Returns a warning for each host that cannot be reached."""
    others = other_hosts(url, conn)
    if not others:
        return []
    row = conn.execute("SELECT current_setting('max_prepared_transactions')::int").fetchone()
    assert row is not None
    wanted = int(row[0])
    warnings = []
    for host, port in others:
        try:
            with psycopg.connect(psycopg.conninfo.make_conninfo(
                    url, host=host, port=str(port), target_session_attrs="any",
                    connect_timeout=str(max(1, round(timeout)))), autocommit=True) as other:
                # Unpinned and read once: every name qualified (see pin_search_path).
                found = other.execute(
                    "SELECT pg_catalog.current_setting('max_prepared_transactions')::int,"
                    " pg_catalog.pg_is_in_recovery()").fetchone()
        except psycopg.Error as exc:
            warnings.append(f"standby {host}:{port} not checked: {describe(exc)}")
            continue
        assert found is not None
        value, in_recovery = int(found[0]), bool(found[1])
        if in_recovery and value < wanted:
            raise StartupCheckError(
                f"standby {host}:{port} has max_prepared_transactions = {value}, below the "
                f"primary's {wanted}: it pauses replay, and promoted it could not hold the "
                f"relays' prepared batches; set it to {wanted} or more and restart it")
    return warnings


def warn_unchecked(warnings: list[str]) -> None:
    for warning in warnings:
        log.warning("%s", warning, extra={"action": "standby_unchecked"})


def missing_schema(tables: Tables) -> StartupCheckError:
    """The one-line error for an outbox or dead-letter table that does not exist."""
    return StartupCheckError(f"table {tables.name!r} or {tables.dead_letter_name!r} does not "
                             "exist: run `outbox-relay migrate` first")


def read_ledger_key(conn: psycopg.Connection[Any], tables: Tables) -> tuple[bytes, str]:
    """(the ledger key, this database's name); a missing or unreadable key is a startup error:
    without it no ledger record can be signed or believed."""
    name = tables.ledger_key_name
    try:
        row = conn.execute(tables.query("ledger_key")).fetchone()
    except psycopg.errors.UndefinedTable:
        raise StartupCheckError(f"table {name!r} (the ledger key) does not exist: run "
                                "`outbox-relay migrate`") from None
    except psycopg.errors.InsufficientPrivilege:
        raise StartupCheckError(
            f"permission denied reading {name!r} (the ledger key): the relays and the resolver "
            "need SELECT on it (sql/roles.sql); run `outbox-relay migrate`, then roles.sql") from None
    if row is None or row[0] is None or len(bytes(row[0])) < 16:
        raise StartupCheckError(f"table {name!r} holds no ledger key: run `outbox-relay migrate`")
    return bytes(row[0]), str(row[1])


# Roles named in the warning of who else can read the ledger key; the rest are counted.
KEY_READERS_SHOWN = 20


def key_readers(conn: psycopg.Connection[Any], tables: Tables) -> tuple[list[str], bool]:
    """(LOGIN roles besides this session's, superusers and the key table's owner that can read
    the ledger key, whether PUBLIC can): the ``key_readers`` query."""
    row = conn.execute(tables.query("key_readers"),
                       {"ledger_key": tables.ledger_key.as_string(None)}).fetchone()
    assert row is not None
    return list(row[0]), bool(row[1])


def warn_key_readers(conn: psycopg.Connection[Any], tables: Tables) -> None:
    """One warning line when anyone but this role, superusers and the table's owner can read
    the ledger key: a check, never a reason not to start."""
    try:
        roles, public = key_readers(conn, tables)
    except psycopg.Error as exc:
        log.warning("who can read the ledger key %s was not checked: %s", tables.ledger_key_name,
                    describe(exc), extra={"action": "ledger_key_readable"})
        return
    if not roles and not public:
        return
    shown = ["PUBLIC (every role)"] * public + roles[:KEY_READERS_SHOWN]
    more = len(roles) - KEY_READERS_SHOWN
    log.warning(
        "roles other than this one (%s), superusers and its owner can read the ledger key %s: "
        "%s%s; whoever reads it can sign ledger records that make the resolver commit batches "
        "that were never published: revoke their SELECT (sql/roles.sql grants it to the "
        "relays' role only)", conn.info.user, tables.ledger_key_name, ", ".join(shown),
        f" and {more} more" if more > 0 else "",
        extra={"action": "ledger_key_readable", "roles": roles, "public": public})


# A row without an ordering key due over this long after now() (a scheduled event) or waiting
# for its retry is "parked": the claims' floor (claim_frontier, relay/marks.py) and the stats
# passes' (stats, outbox_stats) pass it. One value for both: the stats' lowest_unparked must
# use the frontier's predicate, or the relay's stats pass would lower the claims' floor under
# a parked row at every full pass. Longer than a claim's transaction may run before it reads
# now(): a row committed just after a claim began is due at a later now() than the claim's.
PARK_HORIZON = timedelta(seconds=2)
# Dead letters with an ordering key whose keys' rows the claims' floor may pass (the relay
# holds those keys: each one's head reads start where the floor was when it was first seen
# dead, relay/marks.py), and the bytes of their keys: every claim sends the held keys. With
# more, the floor stays below the first of them and their keys' rows, as for every key before.
MAX_HELD_KEYS = 100
MAX_HELD_BYTES = 8192

# A full stats pass reads the rows at or below the passes' floor by id when the aggregate
# listed them (sql/queries.sql, stats_lowest): up to this many; past it, it walks from the
# lowest row, every dead entry a held snapshot keeps above it included.
MAX_LISTED = 10_000

# The bounded stats pass (a lower bound above 0) walks the primary key from its floor: every
# live row is above that floor, so the planner, counting on its statistics, would read the
# whole table instead (and with it every dead tuple a held snapshot keeps). Sequential scans
# off for that statement; JIT off, as the disabled scan's cost would otherwise compile it.
# Bitmap scans off too: stats_lowest's walks in id order stop at their row, where a bitmap
# scan reads the whole range and sorts it, with a key probe per row (a generic plan's choice
# on a drained table's keyed statistics, test_plans.py).
BOUNDED_STATS_SETUP = ("SELECT set_config('enable_seqscan', 'off', true), "
                       "set_config('enable_bitmapscan', 'off', true), "
                       "set_config('jit', 'off', true)")


def _optional(value: Any) -> int | None:
    return None if value is None else int(value)


def outbox_stats(conn: psycopg.Connection[Any], tables: Tables, after: int = 0,
                 floor: int = 0) -> OutboxStats:
    """Backlog, lag and rows never due of the outbox rows with ids above ``after`` (0: the
    whole table), and the lowest id seen (sql/queries.sql, stats). ``conn``: autocommit.

    A full pass (``after`` 0) also reads where the next passes start and what the claims'
    floor must look below (stats_lowest): the rows at or below ``floor`` (where the last
    passes had got to) by id, as the aggregate listed them, then a walk from there. When its
    lowest rows are delayed to a later time (a scheduled event) or wait behind a dead letter
    or a delayed row of their key, it gives as ``lowest`` the first other row, or past the
    last row: the next passes start there. The rows below it are counted once more, in the
    same snapshot, as ``parked_below``, with ``lag_below``, how late the oldest of them is
    (negative: not due yet)."""
    query = tables.query("stats")
    if after > 0:
        with conn.transaction():
            conn.execute(BOUNDED_STATS_SETUP)
            row = conn.execute(query, stats_params(after)).fetchone()
        assert row is not None
        return _stats_row(row)
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        row = conn.execute(query, stats_params(0, floor=floor)).fetchone()
        assert row is not None
        if row[3] is None:
            return _stats_row(row)  # no row
        lowest = int(row[3])
        listed = None if row[5] is None else [int(i) for i in row[5]]
        conn.execute(BOUNDED_STATS_SETUP)  # walks of the primary key, not of the table
        lows = conn.execute(tables.query("stats_lowest"),
                            stats_lowest_params(lowest - 1, listed, floor)).fetchone()
    assert lows is not None
    stats = dataclasses.replace(
        _stats_row(row), lowest_unparked=_optional(lows[0]),
        parked_keys=None if lows[2] is None else {
            str(key): int(low) for key, low in lows[2].items()},
        lowest_parked_key=_optional(lows[3]))
    lowest_due, highest = _optional(lows[1]), _optional(row[4])
    start = lowest_due if lowest_due is not None else (
        None if highest is None else highest + 1)
    if start is None or start <= lowest:
        return stats
    return dataclasses.replace(stats, lowest=start, parked_below=int(lows[4]),
                               lag_below=None if lows[5] is None else float(lows[5]))


def stats_params(after: int, *, floor: int = 0) -> dict[str, Any]:
    """The stats query's parameters for the rows with ids above ``after``; it lists those at
    or below ``floor`` (a full pass's, for stats_lowest)."""
    return {"after": after, "floor": floor, "max_listed": MAX_LISTED}


def stats_lowest_params(after: int, listed: list[int] | None = None,
                        floor: int = 0) -> dict[str, Any]:
    """stats_lowest's parameters: it reads the rows ``listed`` (those at or below ``floor``,
    None: not listed) by id and walks from the floor, or from ``after``, below the lowest
    row, when they are not listed."""
    walk_from = floor if listed is not None and floor > after else after
    return {"floor": walk_from, "listed": listed if walk_from > after else [],
            "park_horizon": PARK_HORIZON, "max_held": MAX_HELD_KEYS,
            "max_held_bytes": MAX_HELD_BYTES}


def _stats_row(row: Any) -> OutboxStats:
    lag = 0.0 if row[1] is None else max(float(row[1]), 0.0)
    return OutboxStats(int(row[0]), lag, int(row[2]), _optional(row[3]))


class StatsSession:
    """The stats passes' own autocommit session (outbox_relay/runtime/stats.py), used by one
    thread: connected like the programs' other sessions (search_path pinned, the table named
    with its schema), and never preparing a statement (a generic plan of ``id > $1`` would
    not know how few rows are above the floor)."""

    def __init__(self, url: str, table: str, *, connect_timeout: float,
                 application_name: str) -> None:
        self._url = url
        self._table = table
        self._connect_timeout = connect_timeout
        self._application_name = application_name
        self.tables = Tables(table)
        self._conn: psycopg.Connection[Any] | None = None

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed and not self._conn.broken

    @property
    def session(self) -> psycopg.Connection[Any]:
        return usable(self._conn)

    @translated
    def connect(self) -> None:
        self.close()
        conn, self.tables = connect_pinned(self._url, self._table, timeout=self._connect_timeout,
                                           application_name=self._application_name)
        conn.prepare_threshold = None
        self._conn = conn

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            conn.close()

    @translated
    def stats(self, after: int, floor: int = 0) -> OutboxStats:
        return outbox_stats(self.session, self.tables, after, floor)


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
