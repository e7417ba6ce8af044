"""The outbox's tables by name: the rule a configured name must follow, and its identifiers.

Every identifier goes through ``psycopg.sql.Identifier``, never string formatting; the SQL
templates of ``outbox_relay.sql`` name them as ``{outbox}``, ``{dead_letter}``, ...
"""

from __future__ import annotations

import re

from psycopg import sql

from outbox_relay import sql as sql_files

# One unquoted-style identifier part; a name with quotes, dots inside a part, spaces or
# semicolons is refused rather than escaped, so logs, metrics and psql all show the same name.
_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,39}$")


def table_name(text: str) -> str:
    """``table`` or ``schema.table``, each part a plain identifier of at most 40 characters."""
    parts = text.split(".")
    if len(parts) > 2 or not all(_IDENT_RE.fullmatch(part) for part in parts):
        raise ValueError(
            "must be a table name like outbox or myschema.outbox "
            "(letters, digits and _, at most 40 characters a part)"
        )
    return text


class Tables:
    """Identifiers for the configured outbox table and its companions, never string-formatted.

    ``schema``: the schema an unqualified ``table`` was found in (postgres.pin_search_path):
    the identifiers then name it, and resolve whatever the session's search_path. The names
    shown to people (``name``, ``dead_letter_name``, ``ledger_key_name``) stay as configured.
    """

    def __init__(self, table: str, *, schema: str | None = None) -> None:
        *given, name = table.split(".")
        self.name = table
        self.dead_letter_name = ".".join([*given, f"{name}_dead_letter"])
        self.ledger_key_name = ".".join([*given, f"{name}_ledger_key"])
        self.schema_name = given[0] if given else schema
        schema_part = [self.schema_name] if self.schema_name else []
        self.outbox = sql.Identifier(*schema_part, name)
        self.dead_letter = sql.Identifier(*schema_part, f"{name}_dead_letter")
        self.ledger_key = sql.Identifier(*schema_part, f"{name}_ledger_key")
        self.message_id_index = sql.Identifier(f"{name}_message_id_key")
        self.retry_index = sql.Identifier(f"{name}_retry_idx")
        self.key_index = sql.Identifier(f"{name}_key_idx")
        self.dead_letter_key_index = sql.Identifier(f"{name}_dead_letter_key_idx")
        # Indexes live in their table's schema: the qualified names, to look them up.
        self.key_indexes = tuple(sql.Identifier(*schema_part, f"{name}{suffix}")
                                 for suffix in ("_key_idx", "_dead_letter_key_idx"))

    def compose(self, template: str) -> sql.Composed:
        return sql.SQL(template).format(
            outbox=self.outbox,
            dead_letter=self.dead_letter,
            # The quoted names as string literals, for regclass casts.
            outbox_text=sql.Literal(self.outbox.as_string(None)),
            dead_letter_text=sql.Literal(self.dead_letter.as_string(None)),
            ledger_key=self.ledger_key,
            message_id_index=self.message_id_index,
            retry_index=self.retry_index,
            key_index=self.key_index,
            dead_letter_key_index=self.dead_letter_key_index,
        )

    def query(self, name: str) -> sql.Composed:
        """A named query of sql/queries.sql for these tables."""
        return self.compose(sql_files.queries()[name])

    def schema(self) -> sql.Composed:
        """sql/schema.sql for these tables."""
        return self.compose(sql_files.text("schema.sql"))
