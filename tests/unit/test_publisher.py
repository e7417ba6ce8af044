"""AmqpPublisher's handling of a connection that is already gone (no broker needed)."""

from __future__ import annotations

from typing import Any

import pytest

from relay import publisher as publisher_module
from relay.publisher import AmqpPublisher


class ClosedConnection:
    """What pika leaves behind when the broker closed the connection: its I/O loop is closed."""

    is_open = False

    def sleep(self, _seconds: float) -> None:
        raise ValueError("Timeout closed before call")  # what pika raises then


def make() -> AmqpPublisher:
    return AmqpPublisher("amqp://guest:guest@127.0.0.1:9/", ledger_stream="ledger",
                         ledger_max_age="7D", confirm_timeout=1, connect_timeout=1)


def test_idle_on_a_connection_the_broker_closed_waits_and_drops_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(publisher_module.time, "sleep", slept.append)
    pub = make()
    pub._conn = ClosedConnection()
    pub.idle(0.25)
    assert slept == [0.25]
    assert pub._conn is None and not pub.connected


def test_publishing_without_a_connection_blames_no_row() -> None:
    pub = make()
    message: Any = publisher_module.Message(1, "m-1", "", "q", b"{}", None)
    result = pub.publish_batch([message])
    assert result.transient and not result.failed and not result.suspect
