"""The shutdown's two signals: the first asks for a graceful stop, the second ends the process."""

from __future__ import annotations

import logging
import signal

import pytest

from outbox_relay.runtime import signals
from outbox_relay.runtime.signals import Shutdown


class Exited(Exception):
    """Raised in place of os._exit so that the test sees the code."""


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise Exited(code)

    monkeypatch.setattr(signals.os, "_exit", fake_exit)  # its os.write(2) goes to pytest's capture
    return codes


def test_the_first_signal_requests_a_stop_and_the_second_exits(exits: list[int]) -> None:
    shutdown = Shutdown()
    shutdown._handle(signal.SIGINT, None)
    assert shutdown.requested and exits == []
    assert shutdown.wait(0) is True
    with pytest.raises(Exited):
        shutdown._handle(signal.SIGTERM, None)
    assert exits == [128 + signal.SIGTERM]


def test_a_second_signal_arriving_during_the_first_one_s_log_line_exits(
        exits: list[int], caplog: pytest.LogCaptureFixture) -> None:
    # Two signals delivered together: CPython runs the second handler between bytecodes of the
    # first, here inside its log call (what a relay SIGSTOPped, sent SIGINT and SIGTERM, did).
    shutdown = Shutdown()

    class Nesting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if getattr(record, "action", None) == "shutdown_requested":
                shutdown._handle(signal.SIGTERM, None)

    handler = Nesting()
    signals.log.addHandler(handler)
    caplog.set_level(logging.INFO, logger=signals.log.name)
    try:
        with pytest.raises(Exited):
            shutdown._handle(signal.SIGINT, None)
    finally:
        signals.log.removeHandler(handler)
    assert exits == [128 + signal.SIGTERM]
    assert shutdown.requested
