"""The main loop both programs share: beat, try one turn, back off on a fault, stop on request.

A program says what one turn is (``turn``), which errors a reconnection can cure (``faults``)
and what to reset after one (``on_fault``); the loop owns the rest, the same for both.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

from prometheus_client import Gauge

from outbox_relay.runtime import backoff
from outbox_relay.runtime.health import Health
from outbox_relay.runtime.signals import Stop


class Loop(ABC):
    """Runs ``turn`` until ``shutdown`` is requested; a fault in ``faults`` never ends it."""

    program: str  # "relay" or "resolver": its started/stopped log lines and actions
    faults: tuple[type[BaseException], ...]

    def __init__(self, *, log: logging.Logger, health: Health, last_loop: Gauge, shutdown: Stop,
                 max_delay: float) -> None:
        self.log = log
        self.health = health
        self.shutdown = shutdown
        self._last_loop = last_loop
        self._max_delay = max_delay

    @abstractmethod
    def turn(self) -> float | None:
        """One pass of the program's work: the seconds to pause before the next, None for none."""

    @abstractmethod
    def on_fault(self, exc: BaseException, failures: int) -> None:
        """``exc`` (one of ``faults``) ended a turn, the ``failures``-th in a row: reset what it
        left unusable; the loop backs off next."""

    def on_recovered(self) -> None:  # noqa: B027 (a hook: most loops need nothing here)
        """A turn succeeded after at least one fault."""

    @abstractmethod
    def close(self) -> None: ...

    def log_fields(self) -> dict[str, object]:
        """Fields of the started/stopped log lines."""
        return {}

    def run(self) -> None:
        self.log.info("%s started", self.program,
                      extra={"action": f"{self.program}_started", **self.log_fields()})
        failures = 0
        while not self.shutdown.requested:
            self._last_loop.set_to_current_time()
            self.health.beat()
            try:
                pause = self.turn()
            except self.faults as exc:
                failures += 1
                self.on_fault(exc, failures)
                self.sleep(backoff.delay(failures, self._max_delay))
                continue
            if failures:
                self.on_recovered()
                failures = 0
            if pause is not None:
                self.pause(pause)
        self.health.stopping()
        self.close()
        self.log.info("%s stopped", self.program,
                      extra={"action": f"{self.program}_stopped", **self.log_fields()})

    def pause(self, seconds: float) -> None:
        """The wait between two successful turns."""
        self.sleep(seconds)

    def sleep(self, seconds: float) -> None:
        """Wait (to reconnect, or for the next scan), cut short by a stop. The probe's stall
        threshold is three times the longest such wait: a beat on each side is enough."""
        self.health.beat()
        self.shutdown.wait(seconds)
        self.health.beat()
