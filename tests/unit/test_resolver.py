"""Every decision of the resolver, against fakes that keep PostgreSQL's and the ledger's rules
(tests/unit/fakes.py; the same decisions against real servers: tests/integration)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest

from outbox_relay import ledger
from outbox_relay.errors import TransientError
from outbox_relay.gid import Gid, lock_class
from outbox_relay.model import HorizonHolder, PreparedXact, SessionRole
from outbox_relay.resolver import worker
from outbox_relay.resolver.metrics import ResolverMetrics
from outbox_relay.resolver.settings import ResolverSettings
from outbox_relay.resolver.worker import Resolver
from tests.unit.fakes import (
    LEDGER_KEY,
    RELAY_ROLE,
    T0,
    FakeCluster,
    FakeLedger,
    FakePreparedStore,
    StopWhen,
)

LOCKS = lock_class("outbox")
HARD_LIMIT = 300.0
MARGIN = 60.0


@dataclass
class World:
    """One PostgreSQL server and one ledger, shared by relays and resolvers."""

    cluster: FakeCluster = field(default_factory=FakeCluster)
    ledger: FakeLedger = field(init=False)

    def __post_init__(self) -> None:
        self.ledger = FakeLedger(self.cluster)

    def resolver(self, name: str = "resolver", *, role: SessionRole = RELAY_ROLE,
                 **settings: Any) -> Resolver:
        values: dict[str, Any] = dict(database_url="postgresql://x@h/db",
                                      amqp_url="amqp://x@h/%2F", hard_limit=HARD_LIMIT,
                                      ledger_margin=MARGIN)
        values.update(settings)
        return Resolver(ResolverSettings(**values), metrics=ResolverMetrics(),
                        store=FakePreparedStore(self.cluster, name=name, role=role),
                        ledger=self.ledger, shutdown=StopWhen(), background_stats=False)

    def batch(self, instance: int, sequence: int = 1, *, alive: bool = False,
              owner: str = "relay", at: float | None = None) -> PreparedXact:
        """A batch relay ``instance`` prepared; ``alive``: the relay's session still holds its
        instance lock."""
        xact = self.cluster.prepare(str(Gid("outbox", instance, sequence)), at=at, owner=owner)
        if alive:
            self.cluster.hold_lock(LOCKS, instance, relay_session(instance))
        return xact

    def finished_by(self, session: str) -> list[tuple[str, bool]]:
        return [(gid, commit) for gid, commit, by in self.cluster.finished if by == session]


def relay_session(instance: int) -> str:
    return f"relay-{instance:08x}"


def decisions(resolver: Resolver, decision: str) -> float:
    value = resolver.metrics.registry.get_sample_value("outbox_resolver_decisions_total",
                                                       {"outcome": decision})
    return value or 0.0


@pytest.fixture
def world() -> World:
    return World()


# -- a dead relay's batch: the ledger decides --------------------------------------------------


def test_a_dead_relays_batch_in_the_ledger_is_committed(world: World) -> None:
    xact = world.batch(0xA)
    world.ledger.record(xact, count=7)
    resolver = world.resolver()

    assert resolver.resolve_once() == {xact.gid: "committed"}

    assert world.cluster.finished == [(xact.gid, True, "resolver")]
    assert decisions(resolver, "committed") == 1
    assert world.cluster.locks == {}  # the relay's lock, taken to decide, is released


def test_a_dead_relays_batch_missing_from_the_ledger_is_rolled_back(world: World) -> None:
    xact = world.batch(0xA)

    assert world.resolver().resolve_once() == {xact.gid: "rolled_back"}

    assert world.cluster.finished == [(xact.gid, False, "resolver")]


def test_the_ledger_is_read_from_a_margin_before_the_oldest_candidate(world: World) -> None:
    world.cluster.now = 500.0
    old, new = world.batch(0xA, at=100.0), world.batch(0xB, at=400.0)

    world.resolver().resolve_once()

    [read] = world.ledger.reads
    assert read.since == T0 + timedelta(seconds=100.0 - MARGIN)
    assert read.candidates == {old.gid: ledger.Expected(old.xid, "app"),
                               new.gid: ledger.Expected(new.xid, "app")}


# -- a live relay's batch is its own, until the hard limit --------------------------------------


def test_a_live_relays_batch_is_left_alone(world: World) -> None:
    world.batch(0xA, alive=True)

    assert world.resolver().resolve_once() == {}

    assert world.cluster.finished == [] and world.ledger.reads == []
    assert world.cluster.locks == {(LOCKS, 0xA): relay_session(0xA)}


def test_a_batch_is_decided_once_its_relay_is_gone(world: World) -> None:
    xact = world.batch(0xA, alive=True)
    resolver = world.resolver()
    resolver.resolve_once()

    world.cluster.end_session(relay_session(0xA))  # the relay died: its lock is free

    assert resolver.resolve_once() == {xact.gid: "rolled_back"}


def test_a_batch_past_the_hard_limit_is_decided_even_with_its_relay_alive(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    stuck = world.batch(0xA, alive=True, at=0.0)
    young = world.batch(0xA, 2, at=HARD_LIMIT)
    world.ledger.record(stuck)
    world.cluster.now = HARD_LIMIT + 1

    with caplog.at_level(logging.WARNING, logger="resolver"):
        outcomes = world.resolver().resolve_once()

    assert outcomes == {stuck.gid: "committed"}
    assert young.gid in world.cluster.prepared
    assert [r.action for r in caplog.records] == ["hard_limit_reached"]  # type: ignore[attr-defined]
    assert world.cluster.locks == {(LOCKS, 0xA): relay_session(0xA)}  # never the resolver's


# -- whose batch it is ---------------------------------------------------------------------------


def test_a_batch_of_another_role_is_skipped_and_said_once(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    foreign = world.batch(0xA, owner="other_relays")  # relays of another role (it reads the key)
    resolver = world.resolver()

    with caplog.at_level(logging.WARNING, logger="resolver"):
        assert resolver.resolve_once() == {}
        assert resolver.resolve_once() == {}

    assert foreign.gid in world.cluster.prepared
    assert [r.action for r in caplog.records] == ["not_owner"]  # type: ignore[attr-defined]
    assert world.cluster.locks == {}


def test_a_superuser_resolver_finishes_a_batch_of_any_relays_role(world: World) -> None:
    foreign = world.batch(0xA, owner="other_relays")

    outcomes = world.resolver(role=SessionRole("postgres", superuser=True)).resolve_once()

    assert outcomes == {foreign.gid: "rolled_back"}


def test_a_gid_of_our_prefix_but_not_our_format_is_never_touched(world: World) -> None:
    world.cluster.prepare("outbox:not-a-relay-gid")

    assert world.resolver().resolve_once() == {}
    assert "outbox:not-a-relay-gid" in world.cluster.prepared


# -- races: two resolvers, a relay finishing late -----------------------------------------------


def test_two_resolvers_never_decide_the_same_relays_batches_at_once(world: World) -> None:
    xact = world.batch(0xA)
    first, second = world.resolver("first"), world.resolver("second")
    seen_by_second: list[dict[str, str]] = []
    # While the first reads the ledger it holds the dead relay's lock: to the second, that
    # relay looks alive.
    world.ledger.during_read.append(lambda: seen_by_second.append(second.resolve_once()))

    assert first.resolve_once() == {xact.gid: "rolled_back"}

    assert seen_by_second == [{}]
    assert world.finished_by("second") == []
    assert world.cluster.locks == {}


def test_a_batch_finished_by_someone_else_meanwhile_is_already_finished(world: World) -> None:
    xact = world.batch(0xA)
    resolver = world.resolver()
    world.ledger.during_read.append(
        lambda: world.cluster.finish_elsewhere(xact.gid, commit=True))

    assert resolver.resolve_once() == {xact.gid: "already_finished"}

    assert decisions(resolver, "already_finished") == 1
    assert world.finished_by("resolver") == []


# -- the ledger: windows, trust, failures -------------------------------------------------------


def test_candidates_are_decided_oldest_first_a_window_per_ledger_read(world: World) -> None:
    world.cluster.now = 1000.0
    prepared = [world.batch(0x100 + n, at=float(n)) for n in range(600)]
    for n in (0, worker.LEDGER_WINDOW, 2 * worker.LEDGER_WINDOW):
        world.ledger.record(prepared[n])  # the oldest of each window is in the ledger

    outcomes = world.resolver().resolve_once()

    reads = world.ledger.reads
    assert [len(r.candidates) for r in reads] == [
        worker.LEDGER_WINDOW, worker.LEDGER_WINDOW, 600 - 2 * worker.LEDGER_WINDOW]
    assert [r.since for r in reads] == [
        T0 + timedelta(seconds=n - MARGIN)
        for n in (0, worker.LEDGER_WINDOW, 2 * worker.LEDGER_WINDOW)]
    assert reads[0].candidates[prepared[3].gid] == ledger.Expected(prepared[3].xid, "app")
    assert [gid for gid, _commit in world.finished_by("resolver")] == [x.gid for x in prepared]
    assert sum(commit for _gid, commit in world.finished_by("resolver")) == 3
    assert len(outcomes) == 600


@pytest.mark.parametrize(("forgery", "reason"), [
    ({"key": b"not the ledger key" * 2}, "other_key"),  # a key replaced, another table's
    ({"key": b"not the ledger key" * 2,  # a forger who copies our key id
      "tampered": {"kid": ledger.key_id(LEDGER_KEY)}}, "unauthenticated"),
    ({"tampered": {"mac": "0" * 64, "kid": None}}, "malformed"),  # anyone may append to a stream
    ({"tampered": {"count": 999}}, "unauthenticated"),  # altered after signing
    ({"xid": 1}, "other_transaction"),  # signed, for another prepared transaction of that gid
    ({"database": "other"}, "other_transaction"),
])
def test_a_record_that_proves_nothing_is_rejected_and_the_batch_rolled_back(
        world: World, forgery: dict[str, Any], reason: str) -> None:
    xact = world.batch(0xA)
    world.ledger.record(xact, **forgery)
    resolver = world.resolver()

    assert resolver.resolve_once() == {xact.gid: "rolled_back"}

    rejected = resolver.metrics.registry.get_sample_value(
        "outbox_resolver_ledger_records_rejected_total", {"reason": reason})
    assert rejected == 1


def test_a_failed_ledger_read_decides_nothing_and_frees_the_locks(world: World) -> None:
    xact = world.batch(0xA)
    world.ledger.failures.append(TransientError("ledger read made no progress"))
    resolver = world.resolver()

    with pytest.raises(TransientError):
        resolver.resolve_once()

    assert xact.gid in world.cluster.prepared
    assert world.cluster.locks == {}


class OrderedStore(FakePreparedStore):
    """Notes the order of the finish and of the metrics' table-wide queries."""

    def __init__(self, cluster: FakeCluster) -> None:
        super().__init__(cluster)
        self.calls: list[str] = []

    def finish(self, gid: str, *, commit: bool) -> bool:
        self.calls.append("finish")
        return super().finish(gid, commit=commit)

    def xmin_horizon(self, prefix: str) -> dict[str, HorizonHolder]:
        self.calls.append("xmin_horizon")
        return {"outbox_prepared": HorizonHolder(3, 1.0)} if self.cluster.prepared else {}

    def outbox_stats(self) -> tuple[int, float]:
        self.calls.append("outbox_stats")
        return super().outbox_stats()


def test_a_dead_relays_batch_is_finished_before_the_metrics_queries(world: World) -> None:
    """The takeover comes first in a scan: the horizon and backlog queries (table-wide, up to
    tens of milliseconds on a busy server) wait until the batch is finished."""
    world.batch(0xA)
    store = OrderedStore(world.cluster)
    resolver = Resolver(ResolverSettings(database_url="postgresql://x@h/db",
                                         amqp_url="amqp://x@h/%2F"), metrics=ResolverMetrics(),
                        store=store, ledger=world.ledger, background_stats=False)

    resolver.resolve_once()

    assert store.calls == ["finish", "xmin_horizon", "outbox_stats"]
    # The metrics say what is left after the scan: nothing of ours holds VACUUM back.
    assert resolver.metrics.registry.get_sample_value(
        "outbox_xmin_horizon_age_transactions", {"holder": "outbox_prepared"}) == 0


def test_a_scan_that_cannot_decide_still_refreshes_the_metrics(world: World) -> None:
    """A ledger that fails every read leaves batches in doubt: what they hold back must show."""
    world.batch(0xA)
    world.ledger.failures.append(TransientError("ledger read made no progress"))
    store = OrderedStore(world.cluster)
    resolver = Resolver(ResolverSettings(database_url="postgresql://x@h/db",
                                         amqp_url="amqp://x@h/%2F"), metrics=ResolverMetrics(),
                        store=store, ledger=world.ledger, background_stats=False)

    with pytest.raises(TransientError, match="no progress"):
        resolver.resolve_once()

    assert store.calls == ["xmin_horizon", "outbox_stats"]
    assert resolver.metrics.registry.get_sample_value(
        "outbox_xmin_horizon_age_transactions", {"holder": "outbox_prepared"}) == 3


def test_the_loop_retries_a_failed_scan_and_says_when_it_recovered(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    xact = world.batch(0xA)
    world.ledger.failures.append(TransientError("ledger read made no progress"))
    resolver = world.resolver()
    shutdown = resolver.shutdown
    assert isinstance(shutdown, StopWhen)
    shutdown.predicate = lambda: not world.cluster.prepared

    with caplog.at_level(logging.INFO, logger="resolver"):
        resolver.run()

    assert world.finished_by("resolver") == [(xact.gid, False)]
    assert [getattr(r, "action", None) for r in caplog.records] == [
        "resolver_started", "connected", "connected", "scan_failed", "reconnected",
        "reconnected", "resolved_rolled_back", "resolver_recovered", "resolver_stopped"]
    assert resolver.metrics.registry.get_sample_value("outbox_resolver_scan_errors_total") == 1


# -- the watch between scans (resolver/watch.py) ----------------------------------------------


def test_the_watch_ends_the_pause_as_soon_as_a_relay_dies(world: World) -> None:
    world.batch(0xA, alive=True)
    resolver = world.resolver(interval=60, watch_interval=0.1)
    resolver.resolve_once()  # connected; the live relay's batch is left alone
    shutdown = resolver.shutdown
    assert isinstance(shutdown, StopWhen)
    # Alive for three watches, then killed.
    shutdown.predicate = lambda: False
    watches = iter([False, False, True])
    original = shutdown.wait

    def wait(seconds: float) -> bool:
        if next(watches):
            world.cluster.end_session(relay_session(0xA))
        return original(seconds)

    shutdown.wait = wait  # type: ignore[method-assign]

    resolver.pause(60)

    assert shutdown.waits == [0.1, 0.1, 0.1]  # woke at the first watch after the death
