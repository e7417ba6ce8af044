"""Rows never due (available_at 'infinity') leave the outbox for the dead-letter table on the
relay's stats schedule (relay/worker.py, _dead_letter_never_due; issue 32), against the fakes."""

from __future__ import annotations

import logging

import pytest

from tests.unit.relay_rig import make_rig

NEVER = float("inf")


def test_a_row_never_due_is_dead_lettered_once_it_is_its_keys_oldest(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    rig = make_rig(monkeypatch)
    keyless = rig.store.add(available_at=NEVER)
    first = rig.store.add(ordering_key="a")
    never = rig.store.add(ordering_key="a", available_at=NEVER)
    later = rig.store.add(ordering_key="a")

    with caplog.at_level(logging.WARNING, logger="relay"):
        rig.relay._refresh_stats()  # the stats first, before any batch
        # The keyed one waits while the key's older row does: it holds nothing back yet.
        assert list(rig.store.dead_letter) == [keyless]
        assert sorted(rig.store.rows) == [first, never, later]

        rig.relay.stats.next_at = 0.0  # the stats are due again
        rig.relay.turn()  # publishes the key's first row; the stats then move the next one
    assert list(rig.store.dead_letter) == [keyless, never]
    assert sorted(rig.store.rows) == [later]  # held behind the dead letter
    assert rig.dead_lettered("invalid") == 2
    dead = [r for r in caplog.records if getattr(r, "action", "") == "row_dead_lettered"]
    assert [r.row_id for r in dead] == [keyless, never]  # type: ignore[attr-defined]
    assert rig.store.dead_letter[keyless].error.startswith("available_at 'infinity' is never due")


def test_no_row_never_due_no_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch)
    rig.store.add(available_at=10.0)  # delayed: a schedule

    rig.relay.turn()

    assert rig.store.called("dead_letter_never_due") == []
    assert len(rig.store.rows) == 1
