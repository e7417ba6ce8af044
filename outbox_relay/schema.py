"""The outbox's schema: as plain SQL for a table name, and applied (idempotent)."""

from __future__ import annotations

from outbox_relay.postgres import connect
from outbox_relay.tables import Tables


def schema_sql(table: str) -> str:
    """The filled-in schema as plain SQL, for psql or review."""
    return Tables(table).schema().as_string(None)


def migrate(url: str, table: str, *, timeout: float = 10.0) -> None:
    """Create the outbox and dead-letter tables and their indexes if they do not exist."""
    # One transaction, and one lock so two sidecars migrating at once do not collide.
    with connect(url, timeout=timeout, application_name="outbox-relay migrate") as conn, \
            conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('outbox-relay migrate'))")
        conn.execute(Tables(table).schema())


__all__ = ["migrate", "schema_sql"]
