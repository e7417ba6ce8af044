"""Prepared transactions of our gid prefix that no relay made (issue 32, item 2): left alone,
counted, said once; they never stop the scan or wake the watch. Against the fakes of
tests/unit/fakes.py; against real servers: tests/integration/test_foreign_prepared.py."""

from __future__ import annotations

import logging

import pytest

from outbox_relay.model import SessionRole
from outbox_relay.resolver.worker import Resolver
from tests.unit.fakes import StopWhen
from tests.unit.test_resolver import LOCKS, World, relay_session

FOREIGN = ["outbox:ffffffff:1", "outbox:80000000:7", "outbox:00000001:9223372036854775808",
           "outbox:not-a-relay-gid", "outbox:00000001:1\nforged line", "outbox:" + "9" * 192]


@pytest.fixture
def world() -> World:
    return World()


def foreign_gauge(resolver: Resolver, reason: str) -> float | None:
    return resolver.metrics.registry.get_sample_value(
        "outbox_resolver_foreign_prepared_transactions", {"reason": reason})


def said(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.gid, r.reason) for r in caplog.records  # type: ignore[attr-defined]
            if getattr(r, "action", None) == "foreign_prepared"]


def test_gids_no_relay_makes_are_left_alone_and_the_relays_batch_decided(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    for gid in FOREIGN:
        world.cluster.prepare(gid, owner="stranger")
    batch = world.batch(0xA)  # prepared after them: the scan must reach it
    resolver = world.resolver()

    with caplog.at_level(logging.WARNING, logger="resolver"):
        assert resolver.resolve_once() == {batch.gid: "rolled_back"}
        assert resolver.resolve_once() == {}

    assert set(world.cluster.prepared) == set(FOREIGN)
    assert sorted(said(caplog)) == sorted((gid, "gid") for gid in FOREIGN)  # once each
    assert foreign_gauge(resolver, "gid") == len(FOREIGN)
    assert foreign_gauge(resolver, "owner") == 0
    assert world.cluster.locks == {}  # no lock was ever asked for a foreign instance


def test_a_relay_shaped_gid_of_a_role_that_cannot_read_the_key_is_no_relays(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    """A superuser resolver may finish any role's transaction: it must still leave this one."""
    stranger = world.batch(0xB, owner="stranger")
    batch = world.batch(0xA)
    resolver = world.resolver(role=SessionRole("postgres", superuser=True))

    with caplog.at_level(logging.WARNING, logger="resolver"):
        assert resolver.resolve_once() == {batch.gid: "rolled_back"}

    assert stranger.gid in world.cluster.prepared
    assert said(caplog) == [(stranger.gid, "owner")]
    assert foreign_gauge(resolver, "owner") == 1
    assert world.cluster.locks == {}


def test_the_gauge_follows_what_is_prepared_now(world: World) -> None:
    world.cluster.prepare("outbox:ffffffff:1", owner="stranger")
    resolver = world.resolver()
    resolver.resolve_once()
    world.cluster.finish_elsewhere("outbox:ffffffff:1", commit=False)

    resolver.resolve_once()

    assert foreign_gauge(resolver, "gid") == 0


def test_the_same_gid_prepared_again_is_another_transaction_and_said_again(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    resolver = world.resolver()
    with caplog.at_level(logging.WARNING, logger="resolver"):
        for _ in range(2):
            world.cluster.prepare("outbox:ffffffff:1", owner="stranger")
            resolver.resolve_once()
            resolver.resolve_once()
            world.cluster.finish_elsewhere("outbox:ffffffff:1", commit=False)

    assert said(caplog) == [("outbox:ffffffff:1", "gid")] * 2


def test_foreign_transactions_never_wake_the_watch(world: World) -> None:
    """Woken by them, the resolver would scan every watch interval for ever."""
    world.cluster.prepare("outbox:ffffffff:1", owner="stranger")
    world.batch(0xB, owner="stranger")  # its instance lock is free, as a dead relay's
    resolver = world.resolver(interval=60, watch_interval=0.1)
    resolver.resolve_once()
    shutdown = resolver.shutdown
    assert isinstance(shutdown, StopWhen)
    shutdown.predicate = lambda: len(shutdown.waits) >= 50  # 5 s of watches

    resolver.pause(60)

    assert len(shutdown.waits) == 50  # never woken


def test_a_relays_batch_next_to_them_still_wakes_the_watch(world: World) -> None:
    world.cluster.prepare("outbox:ffffffff:1", owner="stranger")
    world.batch(0xB, owner="stranger")
    batch = world.batch(0xA, alive=True)
    resolver = world.resolver(interval=60, watch_interval=0.1)
    resolver.resolve_once()
    shutdown = resolver.shutdown
    assert isinstance(shutdown, StopWhen)
    shutdown.predicate = lambda: len(shutdown.waits) >= 50
    watches = iter([False, False, True])  # alive for two watches, killed during the third
    original = shutdown.wait

    def wait(seconds: float) -> bool:
        if next(watches, False):
            world.cluster.end_session(relay_session(0xA))
        return original(seconds)

    shutdown.wait = wait  # type: ignore[method-assign]

    resolver.pause(60)

    assert shutdown.waits == [0.1, 0.1, 0.1]  # woken by the first watch after the death
    assert resolver.resolve_once() == {batch.gid: "rolled_back"}
    assert (LOCKS, 0xA) not in world.cluster.locks
