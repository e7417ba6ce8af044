"""``outbox-relay compact``: give back the space a long-held snapshot left in the outbox.

While a snapshot is held (a long report, a forgotten BEGIN, a slot catching up), VACUUM may
remove no row deleted after it began, and the outbox grows with every event relayed: 702 MB of
heap and 138 MB of indexes after an hour at 500 events/s, for a few thousand live rows
(docs/performance.md). Once the snapshot ends, VACUUM frees that space for reuse but gives
back neither the heap's pages (it truncates only an empty tail, where new rows keep landing)
nor the indexes' (a B-tree shrinks only when rebuilt). ``VACUUM FULL`` rewrites the table and
its indexes with the live rows only, under an ACCESS EXCLUSIVE lock: every producer's INSERT
and every relay's claim waits while it holds it. So this command bounds that wait:

- a plain VACUUM first (it locks no one out), then the indexes rebuilt by ``REINDEX TABLE
  CONCURRENTLY`` (it locks no writer out either): the old, bloated index files are dropped
  while writers go on, not under the lock;
- the rewrite is ``CLUSTER`` on the primary key, not ``VACUUM FULL``: after the VACUUM it
  reads the few live rows through the index, where VACUUM FULL reads every (empty) page of the
  heap. What is left under the lock is mostly the drop of the old heap file (a scratch
  measurement in the notebook: 331 ms of VACUUM FULL for a 563 MB heap and 242 MB of
  indexes, 144-161 ms this way; TRUNCATE of the same table alone 212 ms). CLUSTER's mark on
  the index is put back as it was, by the owner (a role granted MAINTAIN may not ALTER the
  table: the primary key stays marked);
- the lock is asked for with a short ``lock_timeout`` (a queued ACCESS EXCLUSIVE request
  makes every later INSERT wait behind it), and asked again after a pause: a prepared batch
  (in doubt too) or another session reading the outbox holds it off and is waited out, never
  broken;
- once granted, the rewrite may run ``max_block`` seconds (``statement_timeout``): past that
  it is cancelled and rolled back, the table as it was. A snapshot still held makes the
  rewrite copy every dead row it keeps, and a large backlog is copied row by row: both are
  refused this way, after at most ``lock_timeout + max_block`` of writers waiting.

A rebuild that fails (a new snapshot outlives ``REBUILD_TIMEOUT``, the process is killed)
leaves invalid ``_ccnew``/``_ccold`` indexes, which every INSERT would still maintain: the
next compaction drops them first (``DROP INDEX CONCURRENTLY``), and the rewrite rebuilds the
indexes anyway.

Only the table's owner may REINDEX and CLUSTER it (or, on PostgreSQL 17 and later, a role granted
MAINTAIN on it): run it with the role that ran ``migrate``, not the relays'. The resolver runs
the same compaction by itself once a snapshot held over a minute has ended
(outbox_relay/resolver/compaction.py), when its role may.
"""

from __future__ import annotations

import contextlib
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
# Seconds the concurrent rebuild of the indexes may take (it waits for older snapshots and
# prepared batches, and reads the heap); past them the rewrite rebuilds them under the lock.
REBUILD_TIMEOUT = 60.0

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
    long writers could have waited on it (from the lock request to the commit), attempts, and
    whether the indexes were rebuilt concurrently first (``False``: under the lock)."""

    before: Sizes
    after: Sizes
    blocked_seconds: float
    attempts: int
    rebuilt_concurrently: bool


@dataclass(frozen=True)
class Index:
    name: sql.Identifier  # qualified by its schema
    bare: sql.Identifier  # as CLUSTER wants it (an index lives in its table's schema)
    primary: bool
    clustered: bool
    leftover: bool  # an invalid _ccnew/_ccold: an interrupted REINDEX CONCURRENTLY's


def indexes(conn: psycopg.Connection[Any], tables: Tables) -> list[Index]:
    return [Index(sql.Identifier(schema, name), sql.Identifier(name), primary, clustered,
                  leftover)
            for schema, name, primary, clustered, leftover
            in conn.execute(tables.query("compact_indexes")).fetchall()]


def set_timeouts(conn: psycopg.Connection[Any], *, lock: float, statement: float) -> None:
    """Whole milliseconds, 1 at least (0 would turn a timeout off), the statement's past the
    lock's (a lock not granted in time fails as such)."""
    lock_ms = max(1, round(lock * 1000))
    statement_ms = max(lock_ms + 1, round(statement * 1000))
    conn.execute("SELECT pg_catalog.set_config('lock_timeout', %s, false), "
                 "pg_catalog.set_config('statement_timeout', %s, false)",
                 (f"{lock_ms}ms", f"{statement_ms}ms"))


def reset_timeouts(conn: psycopg.Connection[Any]) -> None:
    if not conn.broken:
        conn.execute("RESET lock_timeout")
        conn.execute("RESET statement_timeout")


# What makes a concurrent rebuild (or the drop of its leftovers) give up, the table unchanged.
GAVE_UP = (pg_errors.QueryCanceled, pg_errors.LockNotAvailable, pg_errors.DeadlockDetected,
           pg_errors.ObjectInUse, pg_errors.FeatureNotSupported)


def drop_leftovers(conn: psycopg.Connection[Any], tables: Tables) -> None:
    """Drop the invalid indexes an interrupted REINDEX CONCURRENTLY left; one still held is
    left for the next compaction."""
    for index in indexes(conn, tables):
        if index.leftover:
            with contextlib.suppress(*GAVE_UP):
                conn.execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(index.name))


def rebuild_indexes(conn: psycopg.Connection[Any], tables: Tables) -> bool:
    """``REINDEX TABLE CONCURRENTLY``, what an interrupted one left dropped first: writers go
    on meanwhile. ``False`` when it did not finish (its leftovers dropped where they can be)."""
    set_timeouts(conn, lock=REBUILD_TIMEOUT, statement=REBUILD_TIMEOUT)
    try:
        drop_leftovers(conn, tables)
        try:
            conn.execute(sql.SQL("REINDEX TABLE CONCURRENTLY {}").format(tables.outbox))
        except GAVE_UP:
            drop_leftovers(conn, tables)
            return False
        return True
    finally:
        reset_timeouts(conn)


def rewrite(conn: psycopg.Connection[Any], tables: Tables, found: list[Index], *,
            put_mark_back: bool) -> None:
    """The rewrite, in one transaction: CLUSTER on the primary key among ``found`` (VACUUM FULL
    on a table without one). CLUSTER marks the index it used: the mark is put back as it was
    when ``put_mark_back`` (only the owner may ALTER the table; a role granted MAINTAIN leaves
    the primary key marked)."""
    primary = next((index for index in found if index.primary), None)
    if primary is None:
        conn.execute(sql.SQL("VACUUM (FULL) {}").format(tables.outbox))
        return
    clustered = next((index for index in found if index.clustered), None)
    with conn.transaction():
        conn.execute(sql.SQL("CLUSTER {} USING {}").format(tables.outbox, primary.bare))
        if not put_mark_back:
            return
        if clustered is None:
            conn.execute(sql.SQL("ALTER TABLE {} SET WITHOUT CLUSTER").format(tables.outbox))
        elif clustered.name != primary.name:
            conn.execute(sql.SQL("ALTER TABLE {} CLUSTER ON {}").format(
                tables.outbox, clustered.bare))


def check_owner(conn: psycopg.Connection[Any], tables: Tables) -> bool:
    """Refuse, before touching anything, a role that may not rewrite the outbox (its plain
    VACUUM would only warn, "skipping", and REINDEX and CLUSTER fail half way). Whether it
    may also ALTER the table: the owner may, a role granted MAINTAIN may not."""
    row = conn.execute(tables.query("compact_allowed")).fetchone()
    assert row is not None
    allowed, owner, may_alter = row
    if not allowed:
        raise StartupCheckError(
            f"this role may not rewrite {tables.name}: run compact as its owner ({owner}), the "
            "role that ran migrate (on PostgreSQL 17 and later, a role granted MAINTAIN on it)")
    return bool(may_alter)


def compact(conn: psycopg.Connection[Any], tables: Tables, *, lock_timeout: float,
            max_block: float, attempts: int, max_dead_rows: int | None = None) -> Compacted:
    """VACUUM, REINDEX CONCURRENTLY, then the rewrite within the bounds above; ``conn`` is an
    autocommit session. ``max_dead_rows``: give up, locking nothing, when the VACUUM left more
    dead rows than that (something still holds the horizon back: the rewrite would copy them
    all)."""
    may_alter = check_owner(conn, tables)
    conn.execute(sql.SQL("VACUUM {}").format(tables.outbox))
    before = Sizes.read(conn, tables)
    if max_dead_rows is not None and before.dead_rows > max_dead_rows:
        raise CompactFailed(
            f"VACUUM left {before.dead_rows} dead rows in {tables.name}: a snapshot, a prepared "
            "transaction or a replication slot still holds them (outbox_xmin_horizon_age_"
            "transactions); nothing rewritten, try again once it is gone")
    rebuilt = rebuild_indexes(conn, tables)
    found = indexes(conn, tables)  # as the rebuild left them, for every attempt
    set_timeouts(conn, lock=lock_timeout, statement=lock_timeout + max_block)
    try:
        for attempt in range(1, attempts + 1):
            started = time.monotonic()
            try:
                rewrite(conn, tables, found, put_mark_back=may_alter)
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
            return Compacted(before, Sizes.read(conn, tables), blocked, attempt, rebuilt)
    finally:
        reset_timeouts(conn)
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
                    "attempts": done.attempts,
                    "indexes_rebuilt_concurrently": done.rebuilt_concurrently})
