"""The stats passes of both programs (backlog, lag, rows never due): where each starts, and the
thread that runs them.

While some session holds a snapshot, nothing removes the dead tuples of published rows, and a
pass over the whole table (sql/queries.sql, stats) reads every one of them every
OUTBOX_STATS_INTERVAL: 1.8 million after 15 minutes at 2,000 events/s (issue 36). So a pass
starts from a **floor** (``StatsFloor``): the lowest id the last pass saw, less one, which
only moves forward; each pass then walks about what was published since the last one. Every
``FULL_STATS_INTERVAL`` a pass starts from 0 instead: an exact count of the whole table, which
also finds the rows that appeared below the floor after it moved (a producer's late commit of
an older id, a requeued dead letter that gets its old id back, a row restored with an explicit
id), and sets the floor from what it saw (lower, if need be). Between two such passes the
backlog and lag leave those rows out. A full pass also puts the floor past the rows delayed to
a later time below the first other row (a scheduled event due tomorrow would keep it there,
and every pass would walk the dead entries behind it): the passes until the next full one add
the full pass's count of them to the backlog, and see one that came due (its lag) at the next
full pass. The same for the rows waiting behind a dead letter of their key (a poison event's:
they stay until someone requeues or discards it), which are late already: the passes in
between export the oldest one's lag too, grown from what the full pass saw. A full pass is
given the floor too: its aggregate lists the rows at or below it (those held back there), and
the walks that find where the next passes start read those by id and start at the floor, not
at the lowest row, below every dead entry a held snapshot keeps (postgres.outbox_stats).

The passes run on a daemon thread with a session of their own (``StatsPasses``), so a slow
pass never delays a batch or a resolution; the thread sets the gauges itself (prometheus-client
is thread-safe). A pass that fails (the session lost, the server gone) is logged once
(``stats_failed``) until one succeeds; the session is closed and opened again on the next
attempt, after the interval or the reconnection backoff, whichever is longer.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from outbox_relay.errors import OutboxError, describe
from outbox_relay.model import OutboxStats
from outbox_relay.runtime import backoff

# Seconds between two exact passes over the whole table; the tests shrink it (psycopg_pool
# style: read before each pass).
FULL_STATS_INTERVAL = 60.0
# How long a program's close waits for a pass in progress to end: it runs on a daemon thread
# (the process may exit under it) on a session of its own (closed with the process).
STOP_TIMEOUT = 5.0


class StatsFloor:
    """Where the next stats pass starts (see the module's docstring). Not thread-safe: one
    thread runs the passes."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.floor = 0
        self._last_full: float | None = None  # when the last full pass ran (None: never)
        self.parked = 0  # delayed rows below the floor, as the last full pass counted them
        # How late the oldest of them was at that pass (negative: not due yet), and when.
        self._lag_below: tuple[float, float] | None = None

    def start(self) -> tuple[int, bool]:
        """(after, full) for the pass about to run: it counts the rows with ids above
        ``after``; ``full``: from 0, the whole table. Changes nothing: a pass that fails is
        tried again the same way."""
        if self._last_full is None or self._clock() - self._last_full >= FULL_STATS_INTERVAL:
            return 0, True
        return self.floor, False

    def observe(self, *, full: bool, lowest: int | None, parked: int = 0,
                lag_below: float | None = None) -> None:
        """What the pass that ``start`` set up saw: the lowest id (None: no row) and, for a
        full pass, the rows below it the next passes leave out and how late the oldest of
        them is (OutboxStats.parked_below, lag_below). A full pass sets the floor (lower too);
        another one only moves it forward."""
        if full:
            self._last_full = self._clock()
            self.parked = parked
            # Only rows late already (behind a dead letter of their key): a scheduled one is
            # claimed within a second of its time, and would count as late until the next
            # full pass; it shows at that pass if it is still there.
            self._lag_below = None if not parked or lag_below is None or lag_below < 0 else (
                lag_below, self._last_full)
            if lowest is not None:
                self.floor = lowest - 1
        elif lowest is not None:
            self.floor = max(self.floor, lowest - 1)

    def backlog(self, counted: int, *, full: bool) -> int:
        """The backlog to export: a pass's count, plus the rows below the floor for a pass
        that started there."""
        return counted if full else counted + self.parked

    def export(self, stats: OutboxStats, *, full: bool) -> tuple[int, float]:
        """``observe`` the pass ``start`` set up, which saw ``stats``; the backlog and the lag
        to export."""
        self.observe(full=full, lowest=stats.lowest, parked=stats.parked_below,
                     lag_below=stats.lag_below)
        return self.backlog(stats.backlog, full=full), self.lag(stats.lag, full=full)

    def lag(self, counted: float, *, full: bool) -> float:
        """The lag to export: a pass's, or for a pass that started at the floor, the larger of
        its own and the rows' below the floor, as late as the full pass saw the oldest of them
        plus the time since, when one was late then. Until the next full pass, one published
        since still counts."""
        if full or self._lag_below is None:
            return counted
        lag, at = self._lag_below
        return max(counted, lag + self._clock() - at)


class StatsPasses:
    """Runs ``run_pass`` every ``interval`` seconds, on a daemon thread (``start``) or, for
    the unit tests, when the loop asks (``run_due``). ``run_pass`` connects its session when
    it is not, runs one pass and sets the gauges; ``reset`` closes that session."""

    def __init__(self, *, name: str, interval: float, max_delay: float,
                 run_pass: Callable[[], None], reset: Callable[[], None],
                 log: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self._interval = interval
        self._max_delay = max_delay
        self._run_pass = run_pass
        self._reset = reset
        self._log = log
        self._clock = clock
        self.failures = 0  # passes failed in a row
        self.next_at = 0.0  # when run_due runs the next pass (clock time)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> float:
        """One pass; the seconds to wait before the next."""
        try:
            self._run_pass()
        except Exception as exc:  # a bug too: logged, and the thread goes on
            self.failures += 1
            with contextlib.suppress(Exception):  # closing what failed: nothing more to say
                self._reset()
            if self.failures == 1:
                self._log.warning(
                    "stats pass failed: %s; the backlog and lag metrics are not refreshed until "
                    "one succeeds (retrying)", describe(exc),
                    exc_info=not isinstance(exc, OutboxError),  # a bug: its traceback
                    extra={"action": "stats_failed"})
            return max(self._interval, backoff.delay(self.failures, self._max_delay))
        self.failures = 0
        return self._interval

    def run_due(self) -> None:
        """Run a pass now if one is due (the programs' loops, with no thread)."""
        now = self._clock()
        if now >= self.next_at:
            self.next_at = now + self.step()

    def start(self) -> None:
        """Run the passes on a daemon thread until ``stop``."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """End the thread, waiting for a pass in progress ``timeout`` seconds at most."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                self._log.warning("stats pass still running at shutdown; left to exit with "
                                  "the process", extra={"action": "stats_failed"})

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        try:
            delay = 0.0
            while not self._stop.wait(delay):
                delay = self.step()
        finally:
            with contextlib.suppress(Exception):  # the session goes with the process anyway
                self._reset()


class StatsSource(Protocol):
    """A session the stats passes run on (outbox_relay/postgres.py, StatsSession). Errors:
    TransientError (cannot connect), DatabaseError."""

    @property
    def connected(self) -> bool: ...
    def connect(self) -> None: ...
    def close(self) -> None: ...
    def stats(self, after: int, floor: int = 0) -> OutboxStats: ...


Source = TypeVar("Source", bound=StatsSource)


class LazySession(Generic[Source]):
    """The stats thread's session: made on the first pass, connected whenever it is not,
    closed on ``close`` (a pass failed, the thread ends)."""

    def __init__(self, make: Callable[[], Source]) -> None:
        self._make = make
        self.current: Source | None = None  # None until the first pass

    def get(self) -> Source:
        if self.current is None:
            self.current = self._make()
        if not self.current.connected:
            self.current.connect()
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
