"""Crash points for fault-injection tests: the relay kills itself, or stalls, at a named step.

Set ``OUTBOX_TEST_CRASH_AT`` to one of ``CRASH_POINTS`` (and optionally
``OUTBOX_TEST_CRASH_AFTER`` to the number of times the point is passed first). With
``OUTBOX_TEST_STALL_SECONDS`` as well, the relay sleeps that long at the point instead of dying:
a slow but live relay. Tests use this instead of timing luck; it is not a production setting
and is off when unset.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping

CRASH_POINTS = (
    "after_claim",  # rows locked and deleted, not prepared yet
    "after_prepare",  # prepared, nothing published
    "mid_publish",  # half the batch written to the socket
    "after_publish",  # every message confirmed, no ledger record
    "after_ledger",  # ledger record confirmed, not committed
    "after_commit",  # COMMIT PREPARED done
)


def crash_hook(environ: Mapping[str, str] | None = None) -> Callable[[str], None]:
    """A function to call at each crash point; a no-op unless the environment asks for a crash."""
    environ = os.environ if environ is None else environ
    point = environ.get("OUTBOX_TEST_CRASH_AT", "")
    if not point:
        return lambda _point: None
    if point not in CRASH_POINTS:
        raise ValueError(f"OUTBOX_TEST_CRASH_AT must be one of {', '.join(CRASH_POINTS)}")
    remaining = [int(environ.get("OUTBOX_TEST_CRASH_AFTER", "0"))]
    stall = float(environ.get("OUTBOX_TEST_STALL_SECONDS", "0"))

    def hook(reached: str) -> None:
        if reached != point or remaining[0] < 0:
            return
        if remaining[0] > 0:
            remaining[0] -= 1
            return
        if stall > 0:
            remaining[0] = -1  # stall once, then run normally
            time.sleep(stall)
        else:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook
