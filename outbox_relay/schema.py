"""The outbox's schema: as plain SQL for a table name, applied (idempotent), its version as the
database records it, and the roles script.

The version is the comment ``migrate`` writes on the outbox table (the end of sql/schema.sql):
``outbox-relay schema version N, usable by programs of schema version M or newer``. N is the
schema a program's ``migrate`` creates (``SCHEMA_VERSION``); M, the oldest schema version whose
programs can still run on it. A program runs on a schema whose version is its own, or newer
with M at most its own (an additive change: relays of the version before keep running through a
rolling upgrade); it refuses an older one (run ``migrate``), one that records no version, and a
newer one it cannot use, with one line (StartupCheckError, exit 3).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import psycopg
import psycopg.errors

from outbox_relay import sql as sql_files
from outbox_relay.errors import StartupCheckError
from outbox_relay.postgres import connect_pinned, missing_schema
from outbox_relay.tables import Tables

# What sql/schema.sql creates and records (tests/unit/test_schema_version.py holds them equal).
SCHEMA_VERSION = 3
# Version 2 programs cannot run on version 3: they would publish rows without their
# message_type and correlation_id, and move rows to the dead-letter table without them.
SCHEMA_USABLE_FROM = 3

_RECORDED_RE = re.compile(r"^outbox-relay schema version (\d{1,9}), usable by programs of schema "
                          r"version (\d{1,9}) or newer")


@dataclass(frozen=True)
class SchemaVersion:
    """The schema of one outbox table as the database records it."""

    table: str
    exists: bool  # the outbox and its dead-letter table both exist
    version: int | None = None  # None: no version recorded (outbox-relay 0.1.0, or edited)
    usable_from: int | None = None

    @property
    def problem(self) -> str | None:
        """Why this program cannot run on it, in one line; None when it can."""
        name = self.table
        if not self.exists:
            return str(missing_schema(Tables(name)))
        if self.version is None or self.usable_from is None:
            return (f"table {name!r} records no outbox-relay schema version (made by outbox-relay "
                    "0.1.0, or its comment was changed): run `outbox-relay migrate`")
        if self.version < SCHEMA_VERSION:
            return (f"table {name!r} has schema version {self.version}, this outbox-relay needs "
                    f"version {SCHEMA_VERSION}: run `outbox-relay migrate` (upgrade notes: "
                    "CHANGELOG.md)")
        if self.usable_from > SCHEMA_VERSION:
            return (f"table {name!r} has schema version {self.version}, usable by programs of "
                    f"schema version {self.usable_from} or newer; this outbox-relay's is "
                    f"{SCHEMA_VERSION}: upgrade outbox-relay")
        return None

    def describe(self) -> str:
        """One line for an operator: the version, and whether this program can run on it."""
        problem = self.problem
        if problem is not None:
            return problem
        newer = (f" (newer than this outbox-relay's {SCHEMA_VERSION}, and usable by it)"
                 if self.version != SCHEMA_VERSION else " (current)")
        return f"table {self.table!r} has schema version {self.version}{newer}"


def parse_recorded(table: str, recorded: str | None) -> SchemaVersion:
    """The version of ``table`` from its comment (``recorded``)."""
    found = _RECORDED_RE.match(recorded or "")
    if found is None:
        return SchemaVersion(table, exists=True)
    return SchemaVersion(table, exists=True, version=int(found[1]), usable_from=int(found[2]))


def schema_version(conn: psycopg.Connection[Any], tables: Tables) -> SchemaVersion:
    """The recorded version of ``tables`` (one catalog query; no grant needed)."""
    row = conn.execute(tables.query("schema_version"), {
        "outbox": tables.outbox.as_string(None), "dead_letter": tables.dead_letter.as_string(None),
    }).fetchone()
    assert row is not None
    has_tables, recorded = row
    if not has_tables:
        return SchemaVersion(tables.name, exists=False)
    return parse_recorded(tables.name, recorded)


def check_schema(conn: psycopg.Connection[Any], tables: Tables) -> SchemaVersion:
    """The start-up check of both programs: the version, or a StartupCheckError saying why this
    program cannot run on it."""
    found = schema_version(conn, tables)
    if found.problem is not None:
        raise StartupCheckError(found.problem)
    return found


def check(url: str, table: str, *, timeout: float = 10.0) -> SchemaVersion:
    """``outbox-relay migrate --check``: connect and read the version (check ``.problem``)."""
    conn, tables = connect_pinned(url, table, timeout=timeout,
                                  application_name="outbox-relay migrate --check")
    with conn:
        return schema_version(conn, tables)


def schema_sql(table: str) -> str:
    """The filled-in schema as plain SQL, for psql or review."""
    return Tables(table).schema().as_string(None)


def drop_schema_sql(table: str) -> str:
    """The reverse of ``schema_sql(table)`` as plain SQL (sql/drop_schema.sql), for the downgrade
    of an Alembic or Django migration: drops the three tables, and refuses while the outbox or
    the dead-letter table holds a row."""
    return Tables(table).compose(sql_files.text("drop_schema.sql")).as_string(None)


def migrate(url: str, table: str, *, timeout: float = 10.0) -> None:
    """Create the outbox, dead-letter and ledger-key tables and their indexes if they do not
    exist, upgrade older ones, record the version; a newer schema is left as it is
    (StartupCheckError)."""
    # One transaction, and one lock so two sidecars migrating at once do not collide. The
    # session's search_path is pinned and the tables named with their schema (a migration
    # often runs as a superuser: nothing in the schema may resolve to another role's function).
    conn, tables = connect_pinned(url, table, timeout=timeout,
                                  application_name="outbox-relay migrate")
    with conn:
        try:
            with conn.transaction():
                conn.execute("SELECT pg_catalog.pg_advisory_xact_lock("
                             "pg_catalog.hashtext('outbox-relay migrate'))")
                conn.execute(tables.schema())
        except psycopg.errors.RaiseException as exc:  # the schema's own guard: a newer schema
            raise StartupCheckError(exc.diag.message_primary or str(exc)) from None


def roles_sql() -> str:
    """sql/roles.sql, the least-privilege roles, as psql runs it (it uses psql's variables
    ``table`` and ``roles``): ``outbox-relay migrate --print-roles | psql ... -f -``."""
    return sql_files.text("roles.sql")


__all__ = ["SCHEMA_USABLE_FROM", "SCHEMA_VERSION", "SchemaVersion", "check", "check_schema",
           "drop_schema_sql", "migrate", "parse_recorded", "roles_sql", "schema_sql",
           "schema_version"]
