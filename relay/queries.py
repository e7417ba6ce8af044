"""Named SQL queries, read from the ``.sql`` files shipped with the package."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from pathlib import Path

from psycopg import sql

_NAME_RE = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def parse_named(text: str) -> dict[str, str]:
    """Split a file of ``-- name: x`` sections into {name: SQL text}."""
    parts = _NAME_RE.split(text)
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


@cache
def _store_queries() -> dict[str, str]:
    return parse_named(resources.files("relay").joinpath("queries.sql").read_text("utf-8"))


@cache
def api_queries() -> dict[str, str]:
    """The named queries of the services' API (``api.sql``: relay.producer, relay.inbox)
    without their full-line comments: they also run through SQLAlchemy's text(), which would
    read a ``:word`` inside a comment as a parameter."""
    text = resources.files("relay").joinpath("api.sql").read_text("utf-8")
    return {name: "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("--"))
            for name, body in parse_named(text).items()}


def schema_text(name: str = "schema.sql") -> str:
    """A schema template of the top-level ``sql/`` folder (``schema.sql``: the outbox;
    ``inbox.sql``: the consumers' inbox), shipped in wheels as ``relay.schema``."""
    try:
        return resources.files("relay.schema").joinpath(name).read_text("utf-8")
    except ModuleNotFoundError:  # imported from a source checkout that is not installed
        return (Path(__file__).resolve().parent.parent / "sql" / name).read_text("utf-8")


class Tables:
    """Identifiers for the configured outbox table and its companions, never string-formatted."""

    def __init__(self, table: str) -> None:
        *schema, name = table.split(".")
        self.name = table
        self.dead_letter_name = ".".join([*schema, f"{name}_dead_letter"])
        self.ledger_key_name = ".".join([*schema, f"{name}_ledger_key"])
        self.outbox = sql.Identifier(*schema, name)
        self.dead_letter = sql.Identifier(*schema, f"{name}_dead_letter")
        self.ledger_key = sql.Identifier(*schema, f"{name}_ledger_key")
        self.message_id_index = sql.Identifier(f"{name}_message_id_key")
        self.retry_index = sql.Identifier(f"{name}_retry_idx")
        self.key_index = sql.Identifier(f"{name}_key_idx")
        self.dead_letter_key_index = sql.Identifier(f"{name}_dead_letter_key_idx")
        # Indexes live in their table's schema: the qualified names, to look them up.
        self.key_indexes = tuple(sql.Identifier(*schema, f"{name}{suffix}")
                                 for suffix in ("_key_idx", "_dead_letter_key_idx"))

    def compose(self, template: str) -> sql.Composed:
        return sql.SQL(template).format(
            outbox=self.outbox,
            dead_letter=self.dead_letter,
            # The quoted name as a string literal, for regclass casts.
            dead_letter_text=sql.Literal(self.dead_letter.as_string(None)),
            ledger_key=self.ledger_key,
            message_id_index=self.message_id_index,
            retry_index=self.retry_index,
            key_index=self.key_index,
            dead_letter_key_index=self.dead_letter_key_index,
        )

    def query(self, name: str) -> sql.Composed:
        return self.compose(_store_queries()[name])

    def schema(self) -> sql.Composed:
        return self.compose(schema_text())
