"""CPU time by component, to say what limits the rate on a machine with few cores.

A process's own time plus the time of its children it has reaped: PostgreSQL's postmaster
reaps the backends of relays that disconnected, so their time is not lost when they exit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def process_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of a process; 0.0 if it is gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return 0.0
    fields = data[data.rindex(b")") + 2:].split()
    # After the command name: state is field 3; utime..cstime are fields 14-17.
    return sum(int(f) for f in fields[11:15]) / _TICK


class CpuMeter:
    """CPU seconds each named group of processes spent between start() and stop()."""

    def __init__(self, groups: Mapping[str, Callable[[], list[int]]]) -> None:
        self._groups = groups
        self._start: dict[str, float] = {}
        self.seconds: dict[str, float] = {}  # what the last stop() returned

    def _now(self) -> dict[str, float]:
        return {name: sum(process_seconds(pid) for pid in pids())
                for name, pids in self._groups.items()}

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> dict[str, float]:
        self.seconds = {name: round(seconds - self._start[name], 3)
                        for name, seconds in self._now().items()}
        return self.seconds
