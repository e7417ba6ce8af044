"""The relay loop on the fakes, for the ``test_worker_*`` files and ``test_order.py``: a real
``Relay`` wired to ``FakeStore`` and ``FakePublisher`` (``fakes.py``), their shared journal, its
metrics, and a crash hook that raises at a chosen crash point. The ``rig`` fixture
(``conftest.py``) is ``make_rig`` with the defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from outbox_relay.gid import Gid
from outbox_relay.relay.metrics import RelayMetrics
from outbox_relay.relay.settings import RelaySettings
from outbox_relay.relay.worker import Relay
from tests.unit.fakes import FakePublisher, FakeStore, RawHeaders, StopWhen

INSTANCE = 0xABC


class Crash(Exception):
    """Stands in for the process dying at a crash point."""


@dataclass
class Rig:
    relay: Relay
    store: FakeStore
    publisher: FakePublisher
    journal: list[str]
    faults: list[str] = field(default_factory=list)
    shutdown: StopWhen = field(default_factory=StopWhen)

    @property
    def sleeps(self) -> list[float]:
        """The loop's backoff waits."""
        return self.shutdown.waits

    def step(self) -> int:
        """One turn of the loop without its error handling: reconnect, then one batch."""
        self.relay.ensure_connected()
        return self.relay.run_batch()

    def metric(self, name: str, **labels: str) -> float:
        value = self.relay.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def batches(self, outcome: str) -> float:
        return self.metric("outbox_relay_batches_total", outcome=outcome)

    def row_failures(self, reason: str) -> float:
        return self.metric("outbox_relay_row_failures_total", reason=reason)

    def batch_failures(self, reason: str) -> float:
        return self.metric("outbox_relay_batch_failures_total", reason=reason)

    def dead_lettered(self, reason: str) -> float:
        return self.metric("outbox_relay_dead_lettered_total", reason=reason)

    @property
    def decision(self) -> tuple[str, bool] | None:
        """(gid, commit) of the batch whose decision waits for PostgreSQL, if any."""
        unfinished = self.relay.unfinished
        return None if unfinished is None else (unfinished.gid, unfinished.commit)

    def gid(self, sequence: int) -> str:
        return str(Gid(self.relay.settings.gid_prefix, INSTANCE, sequence))


def make_rig(monkeypatch: pytest.MonkeyPatch, *, missing: set[str] | None = None,
             crash_at: str | None = None, connect: bool = True, **overrides: Any) -> Rig:
    values: dict[str, Any] = dict(
        database_url="postgresql://relay:secret@db/app", amqp_url="amqp://relay:secret@mq/",
        batch_size=10, max_attempts=3, retry_base_delay=0.0, retry_max_delay=0.0,
        poll_min_interval=0.01, poll_max_interval=0.08, max_message_bytes=1000,
    )
    values.update(overrides)
    journal: list[str] = []
    store = FakeStore(journal)
    publisher = FakePublisher(journal, missing=missing)
    faults: list[str] = []

    def fault(point: str) -> None:
        journal.append(f"@{point}")
        faults.append(point)
        if point == crash_at:
            raise Crash(point)

    shutdown = StopWhen()
    relay = Relay(RelaySettings(**values), store, publisher, metrics=RelayMetrics(), fault=fault,
                  shutdown=shutdown, instance=INSTANCE, background_stats=False)
    rig = Rig(relay, store, publisher, journal, faults, shutdown)
    if connect:
        relay.ensure_connected()
        journal.clear()
    return rig


def strip_faults(journal: list[str]) -> list[str]:
    return [entry for entry in journal if not entry.startswith("@")]


def deep(depth: int) -> RawHeaders:
    return RawHeaders('{"a":' * depth + "1" + "}" * depth)
