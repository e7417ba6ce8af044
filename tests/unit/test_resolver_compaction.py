"""When the resolver compacts the outbox (resolver/compaction.py): once after a hold of the xmin
horizon that lasted OUTBOX_RESOLVER_COMPACT_AFTER_HOLD, never without one, again a minute after
a failed try and ten tries at most (no servers; tests/integration/test_compact.py runs the
rewrite on a real PostgreSQL)."""

from __future__ import annotations

from typing import Any

import pytest

from outbox_relay.compact import Sizes
from outbox_relay.model import HorizonHolder, PreparedXact
from outbox_relay.resolver import compaction
from outbox_relay.resolver.compaction import AfterHold, HoldClock
from outbox_relay.resolver.metrics import ResolverMetrics
from outbox_relay.resolver.settings import ResolverSettings
from outbox_relay.resolver.worker import Resolver
from tests.unit.fakes import FakeCluster, FakeLedger, FakePreparedStore
from tests.unit.test_claim_marks import Clock


def test_due_once_every_long_holder_has_let_go() -> None:
    clock = Clock()
    after = AfterHold(60, clock)
    after.observe(59.9)  # a short transaction: no hold
    after.observe(0)
    assert not after.due()
    after.observe(60)
    assert not after.due()  # still held: a rewrite now would copy the rows it keeps
    after.observe(3600)
    assert not after.due()
    after.observe(2)  # it ended; a new, short one is no hold
    assert after.due()
    after.done()
    assert not after.due()
    after.observe(0)
    assert not after.due()  # once per hold


def test_a_new_hold_postpones_a_due_compaction() -> None:
    clock = Clock()
    after = AfterHold(60, clock)
    after.observe(61)
    after.observe(0)
    assert after.due()
    after.observe(70)
    assert not after.due()
    after.observe(0)
    assert after.due()


def test_a_failed_try_is_tried_again_a_minute_later_ten_times_at_most(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compaction, "RETRY_AFTER", 60.0)
    clock = Clock()
    after = AfterHold(60, clock)
    after.observe(61)
    after.observe(0)
    for left in range(compaction.TRIES - 1, 0, -1):
        assert after.due()
        assert after.failed() == left
        assert not after.due()
        clock.now += 59
        assert not after.due()
        clock.now += 1
    assert after.due()
    assert after.failed() == 0  # given up until the next hold
    clock.now += 3600
    assert not after.due()
    after.observe(61)
    after.observe(0)
    assert after.due()


def test_a_hold_is_timed_by_the_same_oldest_xid_or_by_its_age_in_seconds() -> None:
    clock = Clock()
    hold = HoldClock(clock)
    assert hold.held_seconds({}) == {}
    # Another role's session: no age in seconds (xact_start hidden), the same xid scan after scan.
    assert hold.held_seconds({"session": HorizonHolder(10, None, "700")}) == {"session": 0}
    clock.now += 30
    assert hold.held_seconds({"session": HorizonHolder(900, None, "700")}) == {"session": 30}
    clock.now += 30
    assert hold.held_seconds({"session": HorizonHolder(1800, None, "700"),
                              "replication_slot": HorizonHolder(50, None, "2400")}) == {
        "session": 60, "replication_slot": 0}
    clock.now += 2
    # The oldest moved on: short transactions of every kind, none held.
    assert hold.held_seconds({"session": HorizonHolder(3, None, "2450"),
                              "replication_slot": HorizonHolder(4, None, "2449")}) == {
        "session": 0, "replication_slot": 0}
    clock.now += 40
    assert hold.held_seconds({"replication_slot": HorizonHolder(900, None, "2449")}) == {
        "replication_slot": 40}
    # An age PostgreSQL shows counts from the transaction's start, before the scans saw it.
    assert hold.held_seconds({"session": HorizonHolder(10, 75.0, "3000")}) == {"session": 75.0}


class HorizonStore(FakePreparedStore):
    """Answers the horizon from a script; nothing prepared."""

    def __init__(self) -> None:
        super().__init__(FakeCluster())
        self.holders: dict[str, HorizonHolder] = {}

    def prepared(self, prefix: str) -> list[PreparedXact]:
        return []

    def xmin_horizon(self, prefix: str) -> dict[str, HorizonHolder]:
        return dict(self.holders)


def make(**settings: Any) -> tuple[Resolver, HorizonStore]:
    store = HorizonStore()
    resolver = Resolver(ResolverSettings(database_url="postgresql://x@h/db",
                                         amqp_url="amqp://x@h/%2F", **settings),
                        metrics=ResolverMetrics(), store=store, ledger=FakeLedger(store.cluster),
                        background_stats=False)
    return resolver, store


def scan(resolver: Resolver) -> None:
    """One scan with a stats pass due."""
    resolver.stats.next_at = 0.0
    resolver.resolve_once()


def test_the_resolver_compacts_at_the_stats_pass_after_a_long_hold_ends() -> None:
    resolver, store = make(compact_after_hold=60)
    store.sizes = Sizes(heap_bytes=700 * 1024**2, index_bytes=138 * 1024**2, dead_rows=0,
                        live_rows=10)
    scan(resolver)
    store.holders = {"session": HorizonHolder(5_000, 30.0)}
    scan(resolver)
    store.holders = {"session": HorizonHolder(9_000, 61.0)}
    scan(resolver)
    assert store.compactions_due == [False, False, False]
    store.holders = {}
    scan(resolver)
    scan(resolver)
    assert store.compactions_due == [False, False, False, True, False]
    registry = resolver.metrics.registry
    assert registry.get_sample_value("outbox_table_bytes", {"part": "heap"}) == 700 * 1024**2
    assert registry.get_sample_value("outbox_table_bytes", {"part": "indexes"}) == 138 * 1024**2


def test_compact_above_0_turns_it_off() -> None:
    resolver, store = make(compact_after_hold=60, compact_above=0)
    store.holders = {"session": HorizonHolder(9_000, 61.0)}
    scan(resolver)
    store.holders = {}
    scan(resolver)
    assert store.compactions_due == [False, False]
