"""The resolver exports the outbox's backlog and lag: one table-wide query per interval (no
servers; tests/acceptance/test_metrics.py reads them from a real one)."""

from __future__ import annotations

import logging
import math
from typing import Any

import psycopg
import pytest

from relay import store
from relay.config import ResolverSettings
from relay.metrics import ResolverMetrics
from relay.queries import Tables
from resolver.worker import Resolver


def make(monkeypatch: pytest.MonkeyPatch, answers: list[Any], **settings: Any
         ) -> tuple[Resolver, list[str]]:
    resolver = Resolver(ResolverSettings(database_url="postgresql://x@h/db",
                                         amqp_url="amqp://x@h/%2F", **settings),
                        metrics=ResolverMetrics())
    asked: list[str] = []

    def fake(_conn: Any, tables: Tables) -> tuple[int, float]:
        asked.append(tables.name)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[no-any-return]

    monkeypatch.setattr(store, "outbox_stats", fake)
    return resolver, asked


def value(resolver: Resolver, name: str) -> float | None:
    return resolver.metrics.registry.get_sample_value(name)


def test_backlog_and_lag_of_the_configured_table_once_per_interval(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    resolver, asked = make(monkeypatch, [(12, 3.5)], table="app.events", stats_interval=3600)
    for _ in range(3):  # scans every OUTBOX_RESOLVER_INTERVAL; the query once an hour here
        resolver._observe_outbox(None)  # type: ignore[arg-type]
    assert asked == ["app.events"]
    assert value(resolver, "outbox_backlog_events") == 12
    assert value(resolver, "outbox_lag_seconds") == 3.5


@pytest.mark.parametrize("error", [psycopg.errors.UndefinedTable("relation does not exist"),
                                   psycopg.errors.InsufficientPrivilege("permission denied")])
def test_an_unreadable_table_is_nan_and_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    resolver, _asked = make(monkeypatch, [error, error, (0, 0.0)], stats_interval=0.000001)
    with caplog.at_level(logging.WARNING, logger="resolver"):
        resolver._observe_outbox(None)  # type: ignore[arg-type]
        resolver._observe_outbox(None)  # type: ignore[arg-type]
    backlog, lag = value(resolver, "outbox_backlog_events"), value(resolver, "outbox_lag_seconds")
    assert backlog is not None and math.isnan(backlog) and lag is not None and math.isnan(lag)
    assert [r.action for r in caplog.records] == ["outbox_stats_failed"]  # type: ignore[attr-defined]
    resolver._observe_outbox(None)  # type: ignore[arg-type]
    assert value(resolver, "outbox_backlog_events") == 0
