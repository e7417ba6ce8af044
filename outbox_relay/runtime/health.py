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

# What /readyz says of an error: its class of reason, never its text, which names the host,
# the port and the user (libpq: 'connection to server at "db.internal" (10.0.0.5), port 5432
# failed: FATAL: password authentication failed for user "outbox_relay"'). The first class
# whose words the error's text or its causes' class names contain, in this order; the logs
# keep the whole error (connect_failed, scan_failed).
REASONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("authentication failed", ("authentication failed", "no pg_hba.conf entry", "no password",
                               "login was refused", "probableauthenticationerror")),
    ("TLS failed", ("ssl", "certificate", "tls")),
    ("host not found", ("could not translate host name", "failed to resolve host",
                        "name or service not known", "name resolution", "gaierror",
                        "nodename nor servname")),
    ("connection refused", ("connection refused", "connectionrefusederror")),
    ("timed out", ("timeout", "timed out")),
    ("too many connections", ("too many clients", "too many connections",
                              "connection slots are reserved")),
    ("server starting up or shutting down", ("starting up", "shutting down",
                                             "administrator command",
                                             "not yet accepting connections")),
    ("server is read-only", ("read-only", "read only", "in recovery")),
    ("does not exist", ("does not exist",)),
    ("permission denied", ("permission denied", "access_refused", "access refused")),
    ("connection lost", ("server closed the connection", "connection reset", "broken pipe",
                         "eof", "streamlosterror", "connectionclosed", "connection lost",
                         "not connected")),
    ("instance lock busy", ("instance lock busy",)),
    ("ledger stream not available yet", ("ledger stream not available",)),
)


def reason_of(error: BaseException | str) -> str:
    """The class of reason of ``error`` for /readyz (REASONS): "connection refused",
    "authentication failed", ...; else the class name of the error's last cause (a name, never
    a text), or "error"."""
    chain: list[BaseException] = []
    seen: BaseException | None = error if isinstance(error, BaseException) else None
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    # pika keeps the reason in its errors' arguments (an AMQPConnectionError's text is empty).
    haystack = " ".join([str(error), *(f"{type(e).__name__} {e} {e.args!r}"
                                       for e in chain)]).lower()
    for reason, words in REASONS:
        if any(word in haystack for word in words):
            return reason
    named = [type(e).__name__ for e in chain
             if not type(e).__module__.startswith("outbox_relay")]  # the drivers' own
    return named[-1] if named else "error"


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

    def set_check(self, name: str, problem: str | None,
                  cause: BaseException | str | None = None) -> None:
        """``problem`` None: the check passes; otherwise a short phrase of the program's own
        ("reconnecting", "scan failed"), followed by ``cause``'s class of reason (reason_of),
        never its text: /readyz answers anyone who can reach the port."""
        if problem is not None:  # one short line: probe bodies are read by people and kubelets
            if cause is not None:
                problem = f"{problem}: {reason_of(cause)}"
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
