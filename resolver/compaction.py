"""The resolver's compaction of the outbox after a held snapshot (issue 36).

While a snapshot is held, VACUUM removes no outbox row deleted after it began, and the table and
its indexes grow with every event relayed; once it ends, autovacuum makes their pages reusable
but gives none of them back (outbox_relay/compact.py says why). So the resolver, which already
watches what holds the xmin horizon back (every scan), compacts the outbox itself once a holder
that lasted ``OUTBOX_RESOLVER_COMPACT_AFTER_HOLD`` seconds has let go: the same bounded rewrite
as ``outbox-relay compact``, on its stats thread, when the table (heap and indexes) is at least
``OUTBOX_RESOLVER_COMPACT_ABOVE`` MiB. A holder is timed by how long the scans see the same
oldest transaction id behind it (a session's snapshot, a prepared transaction, a replication
slot's xmin), or by the age PostgreSQL shows, the larger.

Only once per hold: a table that is large without one (a backlog, a broker outage) is left
alone. A try that fails (the table never free, the rewrite past its bound, a horizon still
held) is tried again a minute later, ten times at most; a role that may not rewrite the table
(not its owner; PostgreSQL 17 and later: no MAINTAIN) is said once per hold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import psycopg

from outbox_relay import compact
from outbox_relay.errors import StartupCheckError, describe
from outbox_relay.model import HorizonHolder
from outbox_relay.tables import Tables

# Seconds between two tries after one failed, and how many tries a hold gets; tests shrink them.
RETRY_AFTER = 60.0
TRIES = 10
# Dead rows a plain VACUUM may leave for the rewrite still to run: rows deleted by batches
# committed while it ran (its pass over a table grown for an hour takes seconds, and 2,000
# events/s delete 2,000 rows a second), which the rewrite copies in well under its bound. More:
# a holder is still there, and a rewrite would copy all it keeps, to be rolled back at the bound.
MAX_DEAD_ROWS = 100_000

OUTCOMES = ("compacted", "failed", "not_allowed", "not_needed")


class AfterHold:
    """Whether the outbox is due a compaction: from when every holder of the horizon that
    lasted ``after_hold`` seconds let go, until it is done (or given up). Observed on the
    resolver's loop, acted on by its stats thread."""

    def __init__(self, after_hold: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.after_hold = after_hold
        self._clock = clock
        self._lock = threading.Lock()
        self._holding = False
        self._due_at: float | None = None
        self._tries = 0

    def observe(self, held_seconds: float) -> None:
        """``held_seconds``: the age of the oldest holder now (0: none)."""
        with self._lock:
            if held_seconds >= self.after_hold:
                self._holding, self._due_at = True, None  # a rewrite now would copy its rows
            elif self._holding:
                self._holding, self._due_at, self._tries = False, self._clock(), 0

    def due(self) -> bool:
        with self._lock:
            return self._due_at is not None and self._clock() >= self._due_at

    def done(self) -> None:
        """Compacted, not needed, or not this role's to do: nothing more until the next hold."""
        with self._lock:
            self._due_at = None

    def failed(self) -> int:
        """Try again in RETRY_AFTER seconds; the tries left (0: given up until the next hold)."""
        with self._lock:
            if self._due_at is None:  # a new hold began meanwhile: its end reschedules
                return TRIES
            self._tries += 1
            if self._tries >= TRIES:
                self._due_at = None
                return 0
            self._due_at = self._clock() + RETRY_AFTER
            return TRIES - self._tries


class HoldClock:
    """How long the horizon has been held: for each kind of holder, since when the scans have
    seen the same oldest transaction id (no privilege needed: another role's xact_start is
    hidden without pg_read_all_stats, and a replication slot has none), or the age in seconds
    PostgreSQL shows, the larger."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since: dict[str, tuple[str, float]] = {}

    def held_seconds(self, holders: Mapping[str, HorizonHolder]) -> dict[str, float]:
        """Each kind's age now (kinds holding nothing are left out); call it at every scan."""
        now = self._clock()
        since: dict[str, tuple[str, float]] = {}
        ages: dict[str, float] = {}
        for kind, holder in holders.items():
            ages[kind] = holder.age_seconds or 0.0
            if holder.oldest_xid is not None:
                xid, at = self._since.get(kind, (holder.oldest_xid, now))
                at = at if xid == holder.oldest_xid else now
                since[kind] = (holder.oldest_xid, at)
                ages[kind] = max(ages[kind], now - at)
        self._since = since
        return ages


class Compaction:
    """The policy above, for one resolver: ``observe`` on its loop, ``run_if_due`` on its
    stats thread (with the stats session: autocommit, search_path pinned)."""

    def __init__(self, *, after_hold: float, above_mib: float, count: Callable[[str], None],
                 log: logging.Logger) -> None:
        self.after = AfterHold(after_hold)
        self.enabled = above_mib > 0
        self._above_bytes = int(above_mib * 1024**2)
        # outbox-relay compact's bounds, at their defaults: 0.1 s a try at the lock, 30 tries,
        # 2 s for the rewrite.
        self.bounds: dict[str, Any] = {
            option.dest: option.parse(option.default or "")
            for option in (compact.LOCK_TIMEOUT, compact.MAX_BLOCK, compact.ATTEMPTS)}
        self._count = count
        self._log = log

    def observe(self, held: Mapping[str, float]) -> None:
        """``held``: each kind of holder's age (HoldClock), at every scan."""
        if self.enabled:
            self.after.observe(max(held.values(), default=0.0))

    def run_if_due(self, conn: psycopg.Connection[Any], tables: Tables,
                   sizes: compact.Sizes) -> None:
        """``sizes``: the table's, as this stats pass read them."""
        if not (self.enabled and self.after.due()):
            return
        if sizes.heap_bytes + sizes.index_bytes < self._above_bytes:
            self._count("not_needed")
            self.after.done()
            return
        try:
            done = compact.compact(conn, tables, max_dead_rows=MAX_DEAD_ROWS, **self.bounds)
        except compact.CompactFailed as exc:
            self._failed(tables, exc)
        except StartupCheckError as exc:
            self._count("not_allowed")
            self.after.done()
            self._log.warning("not compacting the outbox after a held snapshot: %s", exc,
                              extra={"action": "compact_not_allowed", "table": tables.name,
                                     "heap_bytes": sizes.heap_bytes,
                                     "index_bytes": sizes.index_bytes})
        except psycopg.OperationalError:
            raise  # the session is lost: the stats thread reconnects, and this stays due
        except psycopg.Error as exc:  # refused by PostgreSQL: counted as a failed try
            self._failed(tables, exc)
        else:
            self._count("compacted")
            self.after.done()
            compact.log_compacted(self._log, tables, done)

    def _failed(self, tables: Tables, exc: Exception) -> None:
        self._count("failed")
        left = self.after.failed()
        then = (f"trying again in {RETRY_AFTER:g} s" if left else
                f"gave up after {TRIES} tries: run outbox-relay compact")
        self._log.warning("compaction after a held snapshot failed (%s): %s", then,
                          describe(exc), extra={"action": "compact_failed",
                                                "table": tables.name})
