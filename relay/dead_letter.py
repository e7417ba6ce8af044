"""The operator's view of the dead-letter table: list it (all of it, or what a filter matches),
move rows back into the outbox, discard them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
import psycopg.errors

from outbox_relay.postgres import missing_schema
from outbox_relay.tables import Tables


@dataclass(frozen=True)
class DeadLetter:
    id: int
    message_id: str
    exchange: str
    routing_key: str
    attempts: int
    dead_at: datetime
    last_error: str


@dataclass(frozen=True)
class Selection:
    """Which dead letters: each field that is set narrows it (all of them when none is)."""

    ids: Sequence[int] | None = None
    exchange: str | None = None
    reason: str | None = None  # a substring of last_error, in any case
    older_than: float | None = None  # seconds since dead_at
    newer_than: float | None = None

    @property
    def everything(self) -> bool:
        return all(value is None for value in (self.ids, self.exchange, self.reason,
                                               self.older_than, self.newer_than))

    def params(self) -> dict[str, Any]:
        return {"ids": None if self.ids is None else sorted(set(self.ids)),
                "exchange": self.exchange, "reason": self.reason,
                "older_than": self.older_than, "newer_than": self.newer_than}


@dataclass
class Requeued:
    moved: dict[int, int] = field(default_factory=dict)  # dead-letter id -> its outbox id
    skipped: dict[int, str] = field(default_factory=dict)  # dead-letter id -> message_id
    missing: list[int] = field(default_factory=list)  # ids asked for that are not dead letters


def list_dead_letters(conn: psycopg.Connection[Any], tables: Tables, limit: int | None,
                      selection: Selection | None = None) -> tuple[list[DeadLetter], int]:
    """(up to ``limit`` dead letters of ``selection``, oldest first, all of them for None; how
    many it matches in all)."""
    params = {**(selection or Selection()).params(), "limit": limit}
    try:
        rows = conn.execute(tables.query("dead_letter_list"), params).fetchall()
    except psycopg.errors.UndefinedTable:
        raise missing_schema(tables) from None
    return [DeadLetter(*row[:7]) for row in rows], (rows[0][7] if rows else 0)


def discard(conn: psycopg.Connection[Any], tables: Tables, ids: Sequence[int]) -> list[int]:
    """Delete the dead letters ``ids`` (the ones the operator saw); the ids deleted (one that
    was requeued or discarded meanwhile is not among them)."""
    try:
        rows = conn.execute(tables.query("dead_letter_discard"), {"ids": list(ids)}).fetchall()
    except psycopg.errors.UndefinedTable:
        raise missing_schema(tables) from None
    return sorted(row[0] for row in rows)


def requeue(conn: psycopg.Connection[Any], tables: Tables, ids: Sequence[int] | None) -> Requeued:
    """Move the given dead letters (``None``: all of them) back into the outbox, in ONE
    transaction: attempts 0, due now; a row with an ordering key gets its old outbox id back
    (its key's newer rows waited behind it), any other a new one. A row whose message_id is
    already in the outbox stays where it is (reported in ``skipped``)."""
    result = Requeued()
    wanted = sorted(set(ids or ()))
    try:
        with conn.transaction():
            chosen = conn.execute(tables.query("dead_letter_lock"),
                                  {"all": ids is None, "ids": wanted}).fetchall()
            found = {row[0] for row in chosen}
            result.missing = [i for i in wanted if i not in found]
            move = tables.query("dead_letter_requeue")
            for dead_id, message_id in chosen:
                row = conn.execute(move, {"id": dead_id}).fetchone()
                if row is None:
                    result.skipped[dead_id] = message_id
                else:
                    result.moved[dead_id] = row[1]
    except psycopg.errors.UndefinedTable:
        raise missing_schema(tables) from None
    return result
