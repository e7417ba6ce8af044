"""First SIGTERM/SIGINT: finish or roll back the batch in flight, then exit 0. Second: exit now."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
from types import FrameType
from typing import Protocol

log = logging.getLogger(__name__)


class Stop(Protocol):
    """What a loop asks of its shutdown: whether to stop, and a sleep that a stop cuts short."""

    @property
    def requested(self) -> bool: ...

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True as soon as a stop is requested."""
        ...


class Shutdown:
    """A stop flag set by the first signal; the second signal ends the process at once."""

    def __init__(self) -> None:
        self._event = threading.Event()
        # next() on a count is one C call: a handler nested in another (signals delivered
        # together run the second inside the first's Python code) cannot read the same number.
        self._signals = itertools.count()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self) -> None:
        self._event.set()

    def wait(self, seconds: float) -> bool:
        return self._event.wait(max(0.0, seconds))

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if next(self._signals) > 0:
            # A prepared batch left behind is the resolver's job: nothing is lost.
            os.write(2, b"second signal: exiting at once\n")
            os._exit(128 + signum)
        self.request()  # before the log line: a second signal may arrive during it
        log.info("stopping after the batch in flight", extra={"action": "shutdown_requested",
                                                             "signal": signal.Signals(signum).name})
