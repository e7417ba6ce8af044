"""``outbox-relay compact``: give back the space a long-held snapshot left in the outbox.

While a snapshot is held (a long report, a forgotten BEGIN, a slot catching up), VACUUM may
remove no row deleted after it began, and the outbox grows with every event relayed: 702 MB of
heap and 138 MB of indexes after an hour at 500 events/s, for a few thousand live rows
(docs/performance.md). Once the snapshot ends, VACUUM frees that space for reuse but gives
back neither the heap's pages (it truncates only an empty tail, where new rows keep landing)
nor the indexes' (a B-tree shrinks only when rebuilt). ``VACUUM FULL`` rewrites the table and
its indexes with the live rows only, under an ACCESS EXCLUSIVE lock: every producer's INSERT
and every relay's claim waits while it holds it. So this command bounds that wait:

- a plain VACUUM first (it locks no one out): the rewrite then reads empty pages;
- the lock is asked for with a short ``lock_timeout`` (a queued ACCESS EXCLUSIVE request
  makes every later INSERT wait behind it), and asked again after a pause: a prepared batch
  (in doubt too) or another session reading the outbox holds it off and is waited out, never
  broken;
- once granted, the rewrite may run ``max_block`` seconds (``statement_timeout``): past that
  it is cancelled and rolled back, the table as it was. A snapshot still held makes the
  rewrite copy every dead row it keeps, and a large backlog is copied row by row: both are
  refused this way, after at most ``lock_timeout + max_block`` of writers waiting.

Only the table's owner may VACUUM FULL it (or, on PostgreSQL 17 and later, a role granted
MAINTAIN on it): run it with the role that ran ``migrate``, not the relays'. The resolver runs
the same compaction by itself once a snapshot held over a minute has ended
(outbox_relay/resolver/compaction.py), when its role may.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from outbox_relay.errors import OutboxError, StartupCheckError
from outbox_relay.runtime.options import Option, bounded_int, positive_float
from outbox_relay.tables import Tables

# Pause between two attempts at the lock; the tests shrink it.
RETRY_PAUSE = 1.0

LOCK_TIMEOUT = Option(
    "lock_timeout", "OUTBOX_COMPACT_LOCK_TIMEOUT", positive_float, "0.1",
    "compact (and the resolver's compaction): seconds to wait for the table's exclusive lock "
    "in one attempt (writers queue behind the request meanwhile)",
)
MAX_BLOCK = Option(
    "max_block", "OUTBOX_COMPACT_MAX_BLOCK", positive_float, "2",
    "compact (and the resolver's compaction): seconds the rewrite may hold the table once "
    "locked (producers and relays wait); past them it is rolled back, the table as it was",
)
ATTEMPTS = Option(
    "attempts", "OUTBOX_COMPACT_ATTEMPTS", bounded_int(1, 10_000, "a positive integer"), "30",
    "compact (and the resolver's compaction, each time it tries): attempts at the lock, one "
    "second apart, before giving up",
)


class CompactFailed(OutboxError):
    """The rewrite did not happen (lock never granted, or cancelled at max_block): the table
    is as it was."""


@dataclass(frozen=True)
class Sizes:
    """The outbox's size on disk: heap (and its TOAST), indexes, and the dead rows the
    statistics count."""

    heap_bytes: int
    index_bytes: int
    dead_rows: int
    live_rows: int  # pg_class.reltuples: an estimate, exact after a VACUUM

    @staticmethod
    def read(conn: psycopg.Connection[Any], tables: Tables) -> Sizes:
        row = conn.execute(tables.query("table_size")).fetchone()
        assert row is not None
        return Sizes(int(row[0]), int(row[1]), int(row[2]), max(int(row[3]), 0))


@dataclass(frozen=True)
class Compacted:
    """What a compaction did: sizes before (after the plain VACUUM) and after the rewrite, how
    long writers could have waited on it (from the lock request to the commit), attempts."""

    before: Sizes
    after: Sizes
    blocked_seconds: float
    attempts: int


def check_owner(conn: psycopg.Connection[Any], tables: Tables) -> None:
    """Refuse, before touching anything, a role that may not VACUUM FULL the outbox (PostgreSQL
    would only warn, "skipping", and rewrite nothing)."""
    row = conn.execute(tables.query("compact_allowed")).fetchone()
    assert row is not None
    allowed, owner = row
    if not allowed:
        raise StartupCheckError(
            f"this role may not rewrite {tables.name}: run compact as its owner ({owner}), the "
            "role that ran migrate (on PostgreSQL 17 and later, a role granted MAINTAIN on it)")


def compact(conn: psycopg.Connection[Any], tables: Tables, *, lock_timeout: float,
            max_block: float, attempts: int, max_dead_rows: int | None = None) -> Compacted:
    """VACUUM, then VACUUM FULL within the bounds above; ``conn`` is an autocommit session.
    ``max_dead_rows``: give up, locking nothing, when the VACUUM left more dead rows than that
    (something still holds the horizon back: the rewrite would copy them all)."""
    check_owner(conn, tables)
    conn.execute(sql.SQL("VACUUM {}").format(tables.outbox))
    before = Sizes.read(conn, tables)
    if max_dead_rows is not None and before.dead_rows > max_dead_rows:
        raise CompactFailed(
            f"VACUUM left {before.dead_rows} dead rows in {tables.name}: a snapshot, a prepared "
            "transaction or a replication slot still holds them (outbox_xmin_horizon_age_"
            "transactions); nothing rewritten, try again once it is gone")
    # Whole milliseconds, 1 at least: 0 would turn the timeout off.
    conn.execute("SELECT pg_catalog.set_config('lock_timeout', %s, false)",
                 (f"{max(1, round(lock_timeout * 1000))}ms",))
    conn.execute("SELECT pg_catalog.set_config('statement_timeout', %s, false)",
                 (f"{max(2, round((lock_timeout + max_block) * 1000))}ms",))
    try:
        for attempt in range(1, attempts + 1):
            started = time.monotonic()
            try:
                conn.execute(sql.SQL("VACUUM (FULL) {}").format(tables.outbox))
            except pg_errors.LockNotAvailable:
                if attempt == attempts:
                    raise CompactFailed(
                        f"{tables.name} was never free for {lock_timeout:g} s in {attempts} "
                        "attempts (a batch prepared or in doubt, or a session reading the "
                        "table, holds it: see pg_locks); nothing rewritten, try again later"
                    ) from None
                time.sleep(RETRY_PAUSE)
                continue
            except pg_errors.QueryCanceled:
                raise CompactFailed(
                    f"the rewrite of {tables.name} took over OUTBOX_COMPACT_MAX_BLOCK="
                    f"{max_block:g} s and was rolled back, the table as it was: a snapshot "
                    "still held (outbox_session_transaction_age_seconds) keeps the dead rows, "
                    "or the backlog is large; try again once they are gone"
                ) from None
            blocked = time.monotonic() - started
            return Compacted(before, Sizes.read(conn, tables), blocked, attempt)
    finally:
        if not conn.broken:
            conn.execute("RESET lock_timeout")
            conn.execute("RESET statement_timeout")
    raise AssertionError("unreachable: attempts >= 1")


def mb(size: int) -> str:
    return f"{size / 1024**2:.1f} MB"


def log_compacted(log: logging.Logger, tables: Tables, done: Compacted) -> None:
    """The ``compacted`` line, the command's and the resolver's alike."""
    log.info("compacted %s: table %s -> %s, indexes %s -> %s; writers waited at most %.2f s",
             tables.name, mb(done.before.heap_bytes), mb(done.after.heap_bytes),
             mb(done.before.index_bytes), mb(done.after.index_bytes), done.blocked_seconds,
             extra={"action": "compacted", "table": tables.name,
                    "heap_bytes_before": done.before.heap_bytes,
                    "heap_bytes_after": done.after.heap_bytes,
                    "index_bytes_before": done.before.index_bytes,
                    "index_bytes_after": done.after.index_bytes,
                    "blocked_seconds": round(done.blocked_seconds, 3),
                    "attempts": done.attempts})
