"""Where each claim's walk of the primary key starts: a low-water mark and a floor.

While some session holds a snapshot (a long report, an idle transaction, a standby's feedback),
VACUUM removes none of the rows deleted after it, and a claim that walks the primary key from
its start visits every one of those dead entries, at every claim: 13 -> 85 ms of p99 over 10
minutes at 500 events/s (docs/performance.md). So each claim starts after the **mark**: the
rows at or below it were all gone (claimed, or held back for long) when it was set. The walk is
then about what was claimed since the mark last moved, whatever the snapshot's age.

A row can appear below the mark after it moved: a batch rolled back (its rows keep their ids),
a producer's INSERT that commits after a later id was claimed, a delayed row whose time came,
a key freed (its head published, its dead letter requeued). None is lost or delayed for good:

- the mark moves only to just below the first row a claim would take if no one held it (a
  batch in flight or in doubt, a claim made ahead, a key held behind one): when such a batch
  is rolled back, its rows are above the mark. A batch of ours rolled back, abandoned, or
  finished by someone else puts the mark back to the floor (``rewind``);
- the mark moves past an id only once every transaction that could still insert it has ended:
  the ones holding the outbox's RowExclusiveLock (sql/queries.sql, claim_writers), which every
  INSERT takes before its row gets an id, read right after the claim's snapshot; the mark and
  the floor move no higher than the highest id the claim took (a row it saw). Any id below
  that one came from the sequence earlier, so a transaction that had not committed it at the
  snapshot held the lock then: it is among those writers, or it ended in between and the
  frontier, read after them, sees its row. (Writers read *before* the snapshot miss an INSERT
  that starts in between and commits after: its id is below a later one that committed first,
  and a mark moved past it lost the row for good.) A candidate waits until the writers read
  before a later claim's snapshot are none of its own; that claim walks from the old mark and
  sees what they committed. A claim that takes nothing moves nothing. A session that holds a
  snapshot without writing the outbox does not hold the mark back;
- every ``FULL_LOOK_INTERVAL`` the mark goes back to the **floor** for one claim: the id below
  the first row still there at the last such look (due or not, held back for long or not,
  waiting for a retry or not), below the id a keyed dead letter gets back when it is
  requeued, and below every row of ours in flight. Rows that came back below the mark are
  found then, at most that long after they came back. No row is left below the floor, so a
  key's head is looked for above it too (a key's dead entries would be walked per probe).
  The floor moves with the same care as the mark, so the look from it walks about what was
  claimed since the last one (a second's worth), unless a row held back for long keeps it:
  then that look walks from that row, once every interval (docs/performance.md);
- except a **parked** row: one without an ordering key that waits for its retry or is due
  over 2 s from now (a producer's available_at; postgres.PARK_HORIZON). No key's head read
  looks for it, and retries are claimed by their available_at, not from the mark: the floor
  passes it. Once the first of those not due is due, the look from the floor goes back
  below the lowest of them (at the first look after its time, so at most an interval late,
  as before). A scheduled event held back for a day, or a poison row between its retries,
  then costs the looks nothing. What else could bring a parked row back below the floor (a
  producer's UPDATE making it due, or keyed) is seen by the stats passes' full pass, at most
  a minute later (``check_floor``);
- and except the rows of a **dead key**, one with a dead letter (a poison event's: its later
  rows wait behind it until someone requeues or discards it), and that dead letter's old id.
  The look reads the dead letters' keys (sql/queries.sql, claim_frontier) and the relay
  **holds** them (``held``): each key's head reads start where the floor was when the key
  was first seen dead, below every row of it, instead of at the floor; the floor passes its
  rows. The first look that finds a held key's dead letter gone puts the floor (and the
  mark) back below where its head reads started, at once and for good (what waited to move
  them past is dropped): a requeued head gets its old id back there, and goes first. Past
  postgres.MAX_HELD_KEYS such dead letters (or MAX_HELD_BYTES of keys: every claim sends
  them), no key is held, and the floor stays below all of them, as before;
- and except the rows of a **parked key**, one whose head (its oldest row) would be parked if
  it had no key: a poison event between its retries, an event scheduled for tomorrow, with
  its key's later rows waiting behind it. The look finds them (claim_frontier, parked_keys)
  and the relay holds them as it holds the dead keys; the first look that finds a held key's
  head not parked any more (published, due within the horizon, deleted) lets it go and
  looks from below its rows, as for a dead key. Past the same bounds, the floor stays below
  their rows, as before. What else could bring such a row below the floor unheld (a
  producer's UPDATE giving a parked row a key) is seen by the stats passes' full pass
  (``check_floor``).

A new session (connect) starts both at 0: its first claim looks from the start.

Where the marks may move costs three statements of each claim (the writers before and after its
snapshot, its frontier): at a low load, with a few rows a claim, about a fifth of its cost
(benchmarks/NOTEBOOK.md). So only a claim after ``MARK_READ_ROWS`` rows were claimed without
them, every look from the floor, and the first claim after a rewind read them; a claim between
moves nothing (never a loss: the marks only move less far) and walks, besides its own rows, at
most the ``MARK_READ_ROWS`` claimed since the last read. While the mark is at the floor with a
candidate waiting for its writers, every claim reads (the walk from the floor is the longest).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from outbox_relay.model import OutboxStats

FULL_LOOK_INTERVAL = 1.0  # seconds between looks from the floor
# Rows claimed without reading where the marks may move before a claim reads it again (the
# module's docstring); 0: every claim reads it.
MARK_READ_ROWS = 100
# Candidates kept waiting for their writers. A writer that stays (a producer's transaction left
# open) holds all of them; past this many, new ones are dropped (the marks only move less far
# until it ends: never a loss).
MAX_PENDING = 64


@dataclass(frozen=True)
class _Candidate:
    mark: int | None
    floor: int | None
    writers: frozenset[str]  # the transactions that must end before it holds


class ClaimMarks:
    """The mark and the floor of one claim session (see the module's docstring)."""

    def __init__(self, *, interval: float = FULL_LOOK_INTERVAL, read_rows: int = MARK_READ_ROWS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = interval
        self._read_rows = read_rows
        self._unread = read_rows  # rows claimed since the last read: the first claim reads
        self._clock = clock
        self.mark = 0
        self.floor = 0
        self._pending: deque[_Candidate] = deque()
        self._next_full = clock()
        self.full_looks = 0  # how many looks from the floor so far (tests, benchmarks)
        # A floor asked for by another thread (lower_floor), applied by the next start().
        self._lowered: int | None = None
        self._lowered_lock = threading.Lock()
        # Parked rows the floor passed: (the lowest id, the clock() time the first is due).
        self._parked: tuple[int, float] | None = None
        # Keys with a dead letter, which the floor may pass, and where each one's head reads
        # start (the claim's %(held)s): no row of the key is at or below it.
        self.held: dict[str, int] = {}

    def restart(self) -> None:
        """A new claim session: the next claim looks from the start."""
        self.mark = self.floor = 0
        self._pending.clear()
        self._next_full = self._clock()
        self._unread = self._read_rows
        self._parked = None
        self.held = {}

    def rewind(self) -> None:
        """Rows of ours came back (rolled back, abandoned): the next claim looks from the floor."""
        self.mark = self.floor
        self._pending.clear()
        self._unread = self._read_rows  # the next claim reads: the mark moves up again

    def start(self) -> tuple[int, bool]:
        """(after, full) for the claim about to run: it takes rows with ids above ``after``;
        ``full``: a look from the floor, which also reads where the floor may move."""
        now = self._clock()
        with self._lowered_lock:
            lowered, self._lowered = self._lowered, None
        if lowered is not None:  # a full stats pass saw a row at or below the floor
            self.floor = min(self.floor, lowered)
        full = now >= self._next_full or lowered is not None
        if full and self._parked is not None and now >= self._parked[1]:
            # A parked row is due: this look starts below the lowest (and finds the others).
            self.floor = min(self.floor, self._parked[0] - 1)
            self._parked = None
        if full:
            self.rewind()
            self._next_full = now + self._interval
            self.full_looks += 1
        return self.mark, full

    def reads(self, full: bool) -> bool:
        """Whether the claim about to run (``full``: start()'s) reads where the marks may move
        (the module's docstring). If not, it must call ``claimed_unread`` with its rows."""
        if full or self._unread >= self._read_rows:
            self._unread = 0
            return True
        return False

    def claimed_unread(self, rows: int) -> None:
        """A claim that did not read took ``rows`` rows: the next claims walk them too."""
        self._unread += rows

    def check_floor(self, stats: OutboxStats) -> None:
        """Thread-safe: a full stats pass saw ``stats``; a row it found at or below the floor
        that no look from the floor would see (not parked, or of a parked key not held) has
        the next claim look from below it (``lower_floor``)."""
        below = [] if stats.lowest_unparked is None else [stats.lowest_unparked]
        if stats.parked_keys is None:
            below += [] if stats.lowest_parked_key is None else [stats.lowest_parked_key]
        else:
            held = self.held  # replaced whole by the claims' thread, never changed in place
            below += [low for key, low in stats.parked_keys.items() if key not in held]
        if below and min(below) <= self.floor:
            self.lower_floor(min(below) - 1)

    def lower_floor(self, below: int) -> None:
        """Thread-safe: the next claim looks from ``below`` at most (floor and mark lowered to
        it): a full stats pass (outbox_relay/runtime/stats.py) saw a row there, which came
        back below the floor after this session's last look from it."""
        with self._lowered_lock:
            self._lowered = below if self._lowered is None else min(self._lowered, below)

    def observe(self, *, after: int, full: bool, writers: Iterable[str],
                writers_after: Iterable[str], claimed: Iterable[tuple[int, bool]],
                waiting: int | None, first: int | None,
                parked: tuple[int, float] | None = None,
                dead_keys: Mapping[str, int | None] | None = None,
                parked_keys: Iterable[str] | None = None) -> None:
        """What the claim that started after ``after`` saw: the writers read before its
        snapshot and after it (before its frontier's), the (id, fresh) of each row it claimed,
        and its frontier (sql/queries.sql, claim_frontier): ``first`` is the first row that is
        not parked and not of a key in ``dead_keys`` or ``parked_keys`` (the keys of the dead
        letters, each with the lowest id one of them gets back when it is requeued; None: more
        than postgres.MAX_HELD_KEYS of them, and ``first`` is below all), ``parked`` the lowest id
        of the parked rows below it that are not due and the seconds until the first of them
        is, ``parked_keys`` the keys whose head is parked (None: more than
        postgres.MAX_HELD_KEYS of them, and ``first`` is below their rows). A full look that
        is not told ``dead_keys`` and ``parked_keys`` holds none."""
        freed = False
        if full:
            lows: dict[str, int | None] = dict(dead_keys or {})
            for key in parked_keys or ():
                lows.setdefault(key, None)
            held = {key: min(self.held.get(key, after), after if low is None else low - 1)
                    for key, low in lows.items()}
            gone = [low for key, low in self.held.items() if key not in held]
            self.held = held
            if gone:
                # A dead letter went (requeued: back at its old id; discarded): its key's rows
                # below the floor may be taken again, the first of them first. The next claim
                # looks from below them all; no floor or mark seen before moves past them.
                self.floor = min(self.floor, min(gone))
                self.rewind()
                freed = True
        if full and parked is not None:
            low, due_in = parked
            due_at = self._clock() + max(due_in, 0.0)
            if self._parked is not None:
                low, due_at = min(low, self._parked[0]), min(due_at, self._parked[1])
            self._parked = (low, due_at)
        current = frozenset(writers)
        while self._pending and not self._pending[0].writers & current:
            self._apply(self._pending.popleft())
        rows = list(claimed)
        if not rows or freed:
            return  # nothing seen at the claim's snapshot to move past (the module's docstring)
        ceiling = max(row_id for row_id, _fresh in rows)
        fresh = [row_id for row_id, is_fresh in rows if is_fresh]
        mark = waiting - 1 if waiting is not None else max(fresh, default=None)
        if mark is not None:
            mark = min(mark, ceiling)
        floor = None
        if full:
            floor = first - 1 if first is not None else (mark if mark is not None else after)
            # ours, in flight: they may come back (a retried one as its key's head)
            floor = min(floor, min(row_id for row_id, _fresh in rows) - 1)
        candidate = _Candidate(mark, floor, frozenset(writers_after))
        if candidate.writers or self._pending:
            if len(self._pending) < MAX_PENDING:
                self._pending.append(candidate)
        else:
            self._apply(candidate)
        if self._pending and self.mark <= self.floor:
            # Left at the floor (a look from it, a rewind), waiting for writers (our batch in
            # flight among them): the claims walk the most from there, so the next one reads.
            self._unread = self._read_rows

    def _apply(self, candidate: _Candidate) -> None:
        if candidate.floor is not None:
            self.floor = max(self.floor, candidate.floor)
        if candidate.mark is not None:
            self.mark = max(self.mark, candidate.mark)
        self.mark = max(self.mark, self.floor)
