"""The outbox's schema: as plain SQL for a table name, and applied (idempotent)."""

from __future__ import annotations

from outbox_relay.postgres import connect_pinned
from outbox_relay.tables import Tables


def schema_sql(table: str) -> str:
    """The filled-in schema as plain SQL, for psql or review."""
    return Tables(table).schema().as_string(None)


def migrate(url: str, table: str, *, timeout: float = 10.0) -> None:
    """Create the outbox and dead-letter tables and their indexes if they do not exist."""
    # One transaction, and one lock so two sidecars migrating at once do not collide. The
    # session's search_path is pinned and the tables named with their schema (a migration
    # often runs as a superuser: nothing in the schema may resolve to another role's function).
    conn, tables = connect_pinned(url, table, timeout=timeout,
                                  application_name="outbox-relay migrate")
    with conn, conn.transaction():
        conn.execute("SELECT pg_catalog.pg_advisory_xact_lock("
                     "pg_catalog.hashtext('outbox-relay migrate'))")
        conn.execute(tables.schema())


__all__ = ["migrate", "schema_sql"]
