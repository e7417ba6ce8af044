"""Alembic's autogenerate and the tables outbox-relay owns.

The outbox, dead-letter and ledger-key tables (and a consumer's inbox tables) are created by
``outbox-relay migrate``, ``outbox-inbox migrate`` or ``op.execute(outbox_relay.schema_sql(...))``,
never by a SQLAlchemy model: ``alembic revision --autogenerate`` finds them in the database and
not in ``target_metadata``, and proposes to drop them. ``include_object`` leaves them out; give it
to ``context.configure`` in ``env.py``::

    from outbox_relay.alembic import include_object
    context.configure(connection=connection, target_metadata=target_metadata,
                      include_object=include_object)

It knows the default names (outbox, inbox). For others, build one with ``include_object_for``::

    include_object = include_object_for(outbox=["orders_outbox"], inbox=["billing.inbox"])

This module imports neither Alembic nor SQLAlchemy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from outbox_relay.tables import table_name

IncludeObject = Callable[[Any, str | None, str, bool, Any], bool]


def owned_tables(outbox: Iterable[str] = ("outbox",),
                 inbox: Iterable[str] = ("inbox",)) -> frozenset[tuple[str | None, str]]:
    """(schema or None, name) of every table outbox-relay creates for these outbox and inbox
    tables (``[schema.]name`` each, as ``OUTBOX_TABLE`` and ``OUTBOX_INBOX_TABLE`` give them)."""
    found: set[tuple[str | None, str]] = set()
    for tables, suffixes in ((outbox, ("", "_dead_letter", "_ledger_key")),
                             (inbox, ("", "_keys"))):
        for table in tables:
            *schema, name = table_name(table).split(".")
            for suffix in suffixes:
                found.add((schema[0] if schema else None, name + suffix))
    return frozenset(found)


def include_object_for(outbox: Iterable[str] = ("outbox",),
                       inbox: Iterable[str] = ("inbox",)) -> IncludeObject:
    """An ``include_object`` hook that leaves out the tables of ``owned_tables(outbox, inbox)``
    and everything on them (columns, indexes, constraints), and includes everything else."""
    owned = owned_tables(outbox, inbox)

    def include_object(obj: Any, name: str | None, type_: str, reflected: bool,
                       compare_to: Any) -> bool:
        # A table is the object itself; a column, index or constraint names its table.
        table = obj if type_ == "table" else getattr(obj, "table", None)
        if table is None or getattr(table, "name", None) is None:
            return True
        return (getattr(table, "schema", None), table.name) not in owned

    return include_object


include_object: IncludeObject = include_object_for()

__all__ = ["include_object", "include_object_for", "owned_tables"]
