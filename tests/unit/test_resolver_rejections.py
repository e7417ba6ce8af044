"""Each rejected ledger record is counted and logged once, however many scans read it again
(resolver/rejections.py; issue 32: past 10,000 forged records, each was logged again on every
scan)."""

from __future__ import annotations

import json
import logging
import random

import pytest

from outbox_relay import ledger
from outbox_relay.errors import TransientError
from outbox_relay.resolver import rejections, worker
from outbox_relay.resolver.rejections import Offsets, Reported
from outbox_relay.resolver.worker import Resolver
from outbox_relay.runtime.log_actions import ACTIONS
from tests.unit.test_resolver import World


@pytest.fixture
def world() -> World:
    return World()


def counted(resolver: Resolver, reason: str) -> float:
    return resolver.metrics.registry.get_sample_value(
        "outbox_resolver_ledger_records_rejected_total", {"reason": reason}) or 0.0


def lines(caplog: pytest.LogCaptureFixture, action: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", None) == action]


def forged(gid: str) -> bytes:
    return json.dumps({"type": "batch", "v": 1, "gid": gid, "xid": 1, "database": "app",
                       "count": 1, "relay": "x", "mac": "0" * 64}).encode()


def test_10500_junk_records_are_counted_and_logged_once_across_scans(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    for n in range(10_500):
        world.ledger.append(b"not json %d" % n)
    resolver = world.resolver()

    with caplog.at_level(logging.WARNING, logger="resolver"):
        first = world.batch(0xA)
        assert resolver.resolve_once() == {first.gid: "rolled_back"}
        second = world.batch(0xB)  # its read covers every junk record again
        assert resolver.resolve_once() == {second.gid: "rolled_back"}

    assert counted(resolver, "malformed") == 10_500
    assert len(lines(caplog, "ledger_record_rejected")) == worker.REJECTIONS_LOGGED_PER_SCAN
    (summary,) = lines(caplog, "ledger_records_rejected_unlogged")
    assert summary.count == 10_500 - worker.REJECTIONS_LOGGED_PER_SCAN  # type: ignore[attr-defined]
    assert summary.reasons == {"malformed": 10_400}  # type: ignore[attr-defined]


def test_forged_records_of_a_batch_reread_after_a_failed_read_are_not_counted_again(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    xact = world.batch(0xA)
    for _ in range(10_500):
        world.ledger.append(forged(xact.gid))
    world.ledger.lost_at_end.append(TransientError("RabbitMQ connection lost"))
    resolver = world.resolver()

    with caplog.at_level(logging.WARNING, logger="resolver"):
        with pytest.raises(TransientError):
            resolver.resolve_once()
        assert resolver.resolve_once() == {xact.gid: "rolled_back"}

    assert counted(resolver, "unauthenticated") == 10_500
    assert len(lines(caplog, "ledger_record_rejected")) == worker.REJECTIONS_LOGGED_PER_SCAN


def test_a_record_is_reported_when_its_batch_becomes_a_candidate(world: World) -> None:
    """Records of a batch whose relay is alive are not checked; once it is a candidate, they
    are, even though earlier scans read past them."""
    alive = world.batch(0xA, alive=True)
    world.ledger.append(forged(alive.gid))
    resolver = world.resolver()
    world.ledger.append(b"junk")
    other = world.batch(0xB)
    assert resolver.resolve_once() == {other.gid: "rolled_back"}
    assert counted(resolver, "unauthenticated") == 0
    world.cluster.end_session("relay-0000000a")

    assert resolver.resolve_once() == {alive.gid: "rolled_back"}

    assert counted(resolver, "unauthenticated") == 1
    assert counted(resolver, "malformed") == 1


def test_the_logged_per_scan_limit_is_the_documented_one() -> None:
    (action,) = [a for a in ACTIONS if a.actions == ("ledger_records_rejected_unlogged",)]
    assert f"past the first {worker.REJECTIONS_LOGGED_PER_SCAN} " in action.when


# -- offsets as intervals -------------------------------------------------------------------------


def test_offsets_merge_what_touches_and_keep_gaps() -> None:
    offsets = Offsets()
    for low, high in [(10, 20), (30, 40), (21, 21), (50, 50), (22, 29), (45, 60), (5, 5)]:
        offsets.add(low, high)

    assert len(offsets) == 3  # 5, 10-40, 45-60
    assert [n for n in range(70) if n in offsets] == [5, *range(10, 41), *range(45, 61)]


def test_offsets_agree_with_a_set_under_random_adds() -> None:
    rng = random.Random(7)
    offsets, expected = Offsets(), set()
    for _ in range(2000):
        low = rng.randrange(5000)
        high = low + rng.choice([0, 0, 1, 3, 50])
        offsets.add(low, high)
        expected.update(range(low, high + 1))
    assert {n for n in range(5100) if n in offsets} == expected


def test_offsets_keep_at_most_max_intervals_dropping_the_oldest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rejections, "MAX_INTERVALS", 3)
    offsets = Offsets()
    for n in range(0, 100, 10):
        offsets.add(n, n)

    assert len(offsets) == 3 and 90 in offsets and 60 not in offsets


def test_a_read_span_covers_its_candidates_and_the_junk_only() -> None:
    reported = Reported()
    reported.read(["a"], (100, 200))

    assert not reported.first_time("a", 150)
    assert not reported.first_time(None, 150)
    assert reported.first_time("b", 150)  # b was no candidate: its records were not checked
    assert reported.first_time("a", 201)
    assert reported.first_time(None, None) and reported.first_time(None, None)  # no offset


def test_gids_no_longer_prepared_are_forgotten() -> None:
    reported = Reported()
    reported.read(["a", "b"], (0, 10))
    reported.keep(["b"])

    assert reported.first_time("a", 5)
    assert not reported.first_time("b", 5)
    assert not reported.first_time(None, 5)


def test_found_is_a_dict_with_a_span() -> None:
    found = ledger.Found(a=1)
    assert found == {"a": 1} and found.span is None
