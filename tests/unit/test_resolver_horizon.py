"""How the resolver turns the xmin-horizon holders into its two VACUUM metrics (no servers)."""

from __future__ import annotations

import pytest

from outbox_relay.model import HorizonHolder
from outbox_relay.resolver.metrics import HORIZON_HOLDERS, ResolverMetrics
from outbox_relay.resolver.settings import ResolverSettings
from outbox_relay.resolver.worker import Resolver
from tests.unit.fakes import FakeCluster, FakeLedger, FakePreparedStore


def observe(_monkeypatch: pytest.MonkeyPatch,
            holders: dict[str, HorizonHolder]) -> ResolverMetrics:
    cluster = FakeCluster()
    cluster.horizon = dict(holders)
    metrics = ResolverMetrics()
    resolver = Resolver(ResolverSettings(database_url="postgresql://x@h/db",
                                         amqp_url="amqp://x@h/%2F"), metrics=metrics,
                        store=FakePreparedStore(cluster), ledger=FakeLedger(cluster))
    resolver.resolve_once()  # nothing in doubt: the scan only observes
    return metrics


def value(metrics: ResolverMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_every_holder_is_exported_zero_when_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = observe(monkeypatch, {"session": HorizonHolder(12, None)})
    ages = {h: value(metrics, "outbox_xmin_horizon_age_transactions", holder=h)
            for h in HORIZON_HOLDERS}
    assert ages == {"outbox_prepared": 0, "other_prepared": 0, "session": 12,
                    "replication_slot": 0}
    assert value(metrics, "outbox_prepared_holding_vacuum_age_seconds") == 0


@pytest.mark.parametrize(("others", "held"), [
    ({}, 42.5),                                              # nothing else holds anything
    ({"session": HorizonHolder(7, None)}, 42.5),             # a tie: a snapshot taken after ours
    ({"session": HorizonHolder(3, None),
      "replication_slot": HorizonHolder(6, None)}, 42.5),    # everything else is younger
    ({"session": HorizonHolder(8, None)}, 0),                # an older snapshot holds it
    ({"other_prepared": HorizonHolder(900, 3600.0)}, 0),     # someone else's prepared xact
    ({"replication_slot": HorizonHolder(8, None)}, 0),       # a slot
])
def test_our_batch_is_reported_only_while_it_holds_the_horizon(
    monkeypatch: pytest.MonkeyPatch, others: dict[str, HorizonHolder], held: float
) -> None:
    metrics = observe(monkeypatch, {"outbox_prepared": HorizonHolder(7, 42.5), **others})
    assert value(metrics, "outbox_prepared_holding_vacuum_age_seconds") == held
    assert value(metrics, "outbox_xmin_horizon_age_transactions", holder="outbox_prepared") == 7


@pytest.mark.parametrize(("holders", "age"), [
    ({}, 0),                                                  # nothing open
    ({"session": HorizonHolder(12, 640.5)}, 640.5),           # a client's open transaction
    ({"session": HorizonHolder(12, None)}, 0),                # only a walsender or autovacuum
    ({"outbox_prepared": HorizonHolder(7, 900.0)}, 0),        # ours is not a session's
])
def test_a_sessions_open_transaction_is_exported_in_seconds(
    monkeypatch: pytest.MonkeyPatch, holders: dict[str, HorizonHolder], age: float
) -> None:
    metrics = observe(monkeypatch, holders)
    assert value(metrics, "outbox_session_transaction_age_seconds") == age


def test_the_servers_prepared_transaction_slots_are_exported_whoever_holds_them() -> None:
    """Every prepared transaction takes one of the server's slots: ours, foreign ones of our
    prefix and other prefixes alike."""
    cluster = FakeCluster()
    cluster.max_prepared = 10
    for gid in ("other-app:1", "outbox:ffffffff:1"):
        cluster.prepare(gid, owner="someone")
    metrics = ResolverMetrics()
    resolver = Resolver(ResolverSettings(database_url="postgresql://x@h/db",
                                         amqp_url="amqp://x@h/%2F"), metrics=metrics,
                        store=FakePreparedStore(cluster), ledger=FakeLedger(cluster))
    resolver.resolve_once()
    assert value(metrics, "outbox_server_prepared_transactions") == 2
    assert value(metrics, "outbox_server_max_prepared_transactions") == 10
