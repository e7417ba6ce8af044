"""OUTBOX_STANDBY_WAIT with no standby to wait for is a named state (issue 32): the relay
publishes nothing, as before, and says so (relay/worker.py, _waiting_for_standby)."""

from __future__ import annotations

import logging

import pytest

from outbox_relay.errors import StandbyWaitTimeout
from tests.unit.relay_rig import make_rig

TIMEOUT = StandbyWaitTimeout("standby 'standby' did not flush past the claim within 10 s "
                             "(OUTBOX_STANDBY_WAIT); batch rolled back")


def test_batches_that_time_out_waiting_for_the_standby_are_a_named_state(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    rig = make_rig(monkeypatch, standby_wait="standby")
    ids = rig.store.add_many(3)
    waiting = rig.relay.metrics.waiting_for_standby
    timeouts = rig.relay.metrics.standby_wait_timeouts

    with caplog.at_level(logging.INFO, logger="relay"):
        for _ in range(3):
            rig.store.fail("prepare", TIMEOUT, disconnect=False)
            with pytest.raises(StandbyWaitTimeout):
                rig.step()
            rig.relay.on_fault(TIMEOUT)  # as the loop does: the claim is rolled back
            assert waiting._value.get() == 1
        assert timeouts._value.get() == 3
        assert rig.relay.unfinished is None and rig.publisher.published == []
        assert sorted(rig.store.rows) == ids
        assert {r.attempts for r in rig.store.rows.values()} == {0}

        rig.step()  # the standby is back: the batch passes the wait

    assert waiting._value.get() == 0 and rig.store.rows == {}
    actions = [getattr(r, "action", None) for r in caplog.records]
    assert actions.count("standby_wait_timeout") == 1  # once, when the state begins
    assert actions.count("standby_caught_up") == 1


def test_an_empty_outbox_waits_for_no_standby(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, standby_wait="standby")
    rig.store.add()
    rig.store.fail("prepare", TIMEOUT, disconnect=False)
    with pytest.raises(StandbyWaitTimeout):
        rig.step()
    rig.relay.on_fault(TIMEOUT)
    rig.store.rows.clear()  # the rows went another way (an operator, another relay)

    assert rig.step() == 0
    assert rig.relay.metrics.waiting_for_standby._value.get() == 0


def test_without_the_wait_the_gauge_stays_0(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch)
    rig.store.add()
    rig.step()
    assert rig.relay.metrics.waiting_for_standby._value.get() == 0


def test_the_liveness_probe_allows_for_the_standby_wait() -> None:
    from outbox_relay.relay.settings import RelaySettings
    from outbox_relay.relay.worker import relay_health

    urls = {"database_url": "postgresql://relay:secret@db/app",
            "amqp_url": "amqp://relay:secret@mq/"}
    assert relay_health(RelaySettings(**urls, confirm_timeout=30.0)).stall_after == 180
    waiting = RelaySettings(**urls, confirm_timeout=30.0, standby_wait="standby",
                            standby_wait_timeout=120.0)
    assert relay_health(waiting).stall_after == 3 * (120 + 60)
