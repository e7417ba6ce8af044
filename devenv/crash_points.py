"""The relay with crash points, for the tests, the demo and the benchmarks:
``python -m devenv.crash_points [outbox-relay arguments]``.

``outbox-relay run`` reads no crash-point setting (relay/faults.py). This launcher of the
checkout, which the wheel does not ship, reads them and runs the relay's own CLI with the hook;
``devenv/launch.py`` runs it in place of the relay when a launch's environment sets one.

``OUTBOX_TEST_CRASH_AT`` names one of ``CRASH_POINTS``; ``OUTBOX_TEST_CRASH_AFTER`` the number
of times the point is passed first. With ``OUTBOX_TEST_STALL_SECONDS`` as well, the relay sleeps
that long at the point once instead of dying: a slow but live relay.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence

from outbox_relay.relay import cli
from outbox_relay.relay.faults import CRASH_POINTS, Fault, no_fault
from outbox_relay.runtime.exits import EXIT_CONFIG


def crash_hook(environ: Mapping[str, str] | None = None) -> Fault:
    """A function to call at each crash point; a no-op unless the environment asks for a crash."""
    environ = os.environ if environ is None else environ
    point = environ.get("OUTBOX_TEST_CRASH_AT", "")
    if not point:
        return no_fault
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


def main(argv: Sequence[str] | None = None) -> int:
    try:
        fault = crash_hook()
    except ValueError as exc:
        print(f"outbox-relay: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return cli.main(argv, fault=fault)


if __name__ == "__main__":
    sys.exit(main())
