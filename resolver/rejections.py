"""Which rejected ledger records the resolver has reported already: each is counted and logged
once, however many scans read it again.

A scan reads the ledger from a margin before its oldest candidate up to its own marker, so a
record stays in the window of every scan for as long as an older batch is in doubt, and junk
(a record that cannot be read) is in the window of every scan at all. The resolver remembered
the records it had reported in a set it emptied at 10,000: past that many forged records, each
was logged and counted again on every scan (issue 32).

Stream offsets only grow, and a read examines every record from its first offset to its
marker's. So what was reported is kept as intervals of offsets, per in-doubt gid (a record of a
gid is checked only while that gid is a candidate) and for records that name none: after a
complete read, its whole span joins the intervals of its candidates and of the junk, and a
million rejected records in one span cost two numbers.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

# Disjoint intervals kept per key: reads of the same stretch of the ledger merge into one; the
# lowest (oldest) go first past this many.
MAX_INTERVALS = 1000


class Offsets:
    """A set of stream offsets as sorted, disjoint, non-adjacent intervals [low, high]."""

    def __init__(self) -> None:
        self._lows: list[int] = []
        self._highs: list[int] = []

    def __contains__(self, offset: int) -> bool:
        at = bisect.bisect_right(self._lows, offset) - 1
        return at >= 0 and offset <= self._highs[at]

    def __len__(self) -> int:
        """How many intervals."""
        return len(self._lows)

    def add(self, low: int, high: int) -> None:
        """Add the offsets ``low`` to ``high`` (inclusive), merging what touches them."""
        start = bisect.bisect_left(self._highs, low - 1)  # first interval that may touch
        end = bisect.bisect_right(self._lows, high + 1)  # past the last that may touch
        if start < end:
            low, high = min(low, self._lows[start]), max(high, self._highs[end - 1])
        self._lows[start:end] = [low]
        self._highs[start:end] = [high]
        if len(self._lows) > MAX_INTERVALS:
            del self._lows[0], self._highs[0]


class Reported:
    """The rejected records already reported, by the gid they name (None: they name none)."""

    def __init__(self) -> None:
        self._by_gid: dict[str | None, Offsets] = {}

    def first_time(self, gid: str | None, offset: int | None) -> bool:
        """Whether the record at ``offset`` naming ``gid`` is news; it is not from now on. A
        record without an offset (a broker that gave none) is news every time."""
        if offset is None:
            return True
        offsets = self._by_gid.setdefault(gid, Offsets())
        if offset in offsets:
            return False
        offsets.add(offset, offset)
        return True

    def read(self, candidates: Iterable[str], span: tuple[int, int] | None) -> None:
        """A read examined every record of ``span`` with ``candidates``: each rejected record
        there naming one of them, or none, was reported."""
        if span is None:
            return
        for gid in (*candidates, None):
            self._by_gid.setdefault(gid, Offsets()).add(*span)

    def keep(self, gids: Iterable[str]) -> None:
        """Forget the gids no longer prepared (their records are never checked again)."""
        keep = {*gids, None}
        for gid in [gid for gid in self._by_gid if gid not in keep]:
            del self._by_gid[gid]
