"""A named query as an SQL-level prepared statement: parsed once per session, run by EXECUTE.

Not psycopg's own cache of prepared statements: it forgets them all (DEALLOCATE ALL) at every
ROLLBACK the session runs, and a relay rolls back each claim that found nothing. A statement
prepared with SQL's PREPARE is not transactional: it lasts as long as the session, whatever
its transactions do, and a session that is closed takes it along.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg import sql

_PLACEHOLDER = re.compile(r"%%|%\((\w+)\)s")


def numbered(text: str) -> tuple[str, list[str]]:
    """%(name)s placeholders as $1, $2 ... for PREPARE, and %% as %: the text then goes to the
    server as it is, with no parameter for psycopg to fill in. The names in their order."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) is None:
            return "%"
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return _PLACEHOLDER.sub(number, text), names


class PreparedStatement:
    """``query`` (with %(name)s placeholders) prepared as ``name`` on a session."""

    def __init__(self, name: str, query: sql.Composable) -> None:
        self.name = name
        self.query = query
        # The parameters' order, known before any session: identifiers hold no placeholder.
        self.params = numbered(query.as_string(None))[1]

    def prepare(self, conn: psycopg.Connection[Any]) -> None:
        """PREPARE it on autocommit ``conn``, replacing a statement of that name the session
        already has (a server connection PgBouncer hands on without DISCARD ALL, when its
        server_reset_query is empty). PostgreSQL infers each parameter's type from its use."""
        text = numbered(self.query.as_string(conn))[0]  # quoted in the session's encoding
        name = sql.Identifier(self.name)
        prepare = sql.SQL("PREPARE {} AS ").format(name) + sql.SQL(text)  # our own .sql file
        try:
            conn.execute(prepare)
        except psycopg.errors.DuplicatePreparedStatement:
            conn.execute(sql.SQL("DEALLOCATE {}").format(name))
            conn.execute(prepare)

    def execute_query(self, params: Mapping[str, Any]) -> sql.Composed:
        """The EXECUTE statement for ``params``, as literals: EXECUTE takes no bind parameter."""
        query = sql.SQL("EXECUTE {}").format(sql.Identifier(self.name))
        if self.params:
            query += sql.SQL(" ({})").format(
                sql.SQL(", ").join(sql.Literal(params[name]) for name in self.params))
        return query
