"""The resolver exports the outbox's backlog and lag: one table-wide query per interval (no
servers; tests/acceptance/test_metrics.py reads them from a real one)."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest

from outbox_relay.errors import DatabaseError
from outbox_relay.model import HorizonHolder, PreparedXact
from outbox_relay.resolver.metrics import ResolverMetrics
from outbox_relay.resolver.settings import ResolverSettings
from outbox_relay.resolver.store import PostgresPreparedStore
from outbox_relay.resolver.worker import Resolver
from tests.unit.fakes import FakeCluster, FakeLedger, FakePreparedStore


class CountingStore(FakePreparedStore):
    """Answers the stats query from a script and counts the queries."""

    def __init__(self, answers: list[Any]) -> None:
        super().__init__(FakeCluster())
        self.answers = answers
        self.asked = 0

    def outbox_stats(self) -> tuple[int, float]:
        self.asked += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[no-any-return]

    def prepared(self, prefix: str) -> list[PreparedXact]:
        return []

    def xmin_horizon(self, prefix: str) -> dict[str, HorizonHolder]:
        return {}


def make(_monkeypatch: pytest.MonkeyPatch, answers: list[Any], **settings: Any
         ) -> tuple[Resolver, CountingStore]:
    store = CountingStore(answers)
    resolver = Resolver(ResolverSettings(database_url="postgresql://x@h/db",
                                         amqp_url="amqp://x@h/%2F", **settings),
                        metrics=ResolverMetrics(), store=store, ledger=FakeLedger(store.cluster),
                        background_stats=False)
    return resolver, store


def value(resolver: Resolver, name: str) -> float | None:
    return resolver.metrics.registry.get_sample_value(name)


def test_backlog_and_lag_of_the_configured_table_once_per_interval(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    resolver, store = make(monkeypatch, [(12, 3.5)], table="app.events", stats_interval=3600)
    store.blocked = 4
    for _ in range(3):  # scans every OUTBOX_RESOLVER_INTERVAL; the query once an hour here
        resolver.resolve_once()
    assert store.asked == 1
    assert value(resolver, "outbox_backlog_events") == 12
    assert value(resolver, "outbox_lag_seconds") == 3.5
    assert value(resolver, "outbox_blocked_keys") == 4


@pytest.mark.parametrize("error", [
    DatabaseError("relation does not exist", sqlstate="42P01"),      # not migrated yet
    DatabaseError("permission denied", sqlstate="42501"),            # not this role's to read
])
def test_an_unreadable_table_is_nan_and_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    resolver, _store = make(monkeypatch, [error, error, (0, 0.0)], stats_interval=0.000001)
    with caplog.at_level(logging.WARNING, logger="resolver"):
        resolver.resolve_once()
        resolver.resolve_once()
    backlog, lag = value(resolver, "outbox_backlog_events"), value(resolver, "outbox_lag_seconds")
    assert backlog is not None and math.isnan(backlog) and lag is not None and math.isnan(lag)
    assert [r.action for r in caplog.records] == ["outbox_stats_failed"]  # type: ignore[attr-defined]
    resolver.resolve_once()
    assert value(resolver, "outbox_backlog_events") == 0


def test_the_resolver_reads_the_configured_table() -> None:
    resolver = Resolver(ResolverSettings(database_url="postgresql://x@h/db",
                                         amqp_url="amqp://x@h/%2F", table="app.events"))
    assert isinstance(resolver.store, PostgresPreparedStore)
    assert resolver.store.tables.name == "app.events"
