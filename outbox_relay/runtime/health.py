"""Liveness and readiness state of both programs, read by the /healthz and /readyz probes.

The main loop writes (``beat``, ``set_check``); the HTTP server's threads read (``liveness``,
``readiness``). Every access takes one small lock and touches a few Python values, never a
connection: a probe costs nothing and cannot block the loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from outbox_relay.errors import first_line

# Liveness never fails sooner than this, whatever the settings.
MIN_STALL_SECONDS = 30.0


def stall_threshold(*waits: float) -> float:
    """Seconds without a beat after which the loop counts as stuck.

    Three times the longest single wait the loop may legitimately spend between two beats (a
    confirm timeout, a connect timeout, a backoff sleep, a poll interval), and never under 30 s:
    one slow step never fails the probe, a loop that is really stuck fails it within minutes.
    """
    return max(MIN_STALL_SECONDS, 3 * max(waits, default=0.0))


class Health:
    """What the probes report: when the loop last turned, and the named readiness checks."""

    def __init__(self, checks: Sequence[str], *, stall_after: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_after = stall_after
        self._clock = clock
        self._lock = threading.Lock()
        self._last_beat = clock()  # starting counts as turning
        self._checks: dict[str, str | None] = dict.fromkeys(checks, "not connected yet")
        self._stopping = False

    def beat(self) -> None:
        """The loop is turning (also called while it waits to reconnect: docs/operations.md, probes)."""
        now = self._clock()
        with self._lock:
            self._last_beat = now

    def set_check(self, name: str, problem: str | None) -> None:
        """``problem`` None: the check passes; otherwise a short reason it fails."""
        if problem is not None:  # one short line: probe bodies are read by people and kubelets
            problem = (first_line(problem) or "failed")[:200]
        with self._lock:
            self._checks[name] = problem

    def stopping(self) -> None:
        """Shutting down: no longer ready (liveness is unaffected)."""
        with self._lock:
            self._stopping = True

    def liveness(self) -> tuple[bool, str]:
        with self._lock:
            idle = self._clock() - self._last_beat
        if idle > self.stall_after:
            return False, f"main loop has not turned for {idle:.0f} s (limit {self.stall_after:.0f} s)"
        return True, "ok"

    def readiness(self) -> tuple[bool, dict[str, str]]:
        """(ready, {check: "ok" or the reason it fails})."""
        with self._lock:
            checks = {name: problem or "ok" for name, problem in self._checks.items()}
            stopping = self._stopping
        if stopping:
            checks["shutdown"] = "stopping"
        return all(v == "ok" for v in checks.values()), checks
