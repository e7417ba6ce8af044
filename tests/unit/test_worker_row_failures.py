"""Rows that fail on their own (outbox_relay.relay.worker.Relay on the fakes): returned as
unroutable, suspects of a closed channel, addressed to a missing exchange. Only they go back,
with an attempt counted and a backoff; the confirmed rows of their batch are not published
again; after the last attempt a row is dead-lettered, and both are logged."""

from __future__ import annotations

import logging

import pytest

from tests.unit.fakes import CHANNEL_CLOSED, Outcome
from tests.unit.relay_rig import Rig, make_rig

# -- rows the broker refuses ------------------------------------------------------------------


def test_returned_message_fails_only_its_row(rig: Rig) -> None:
    ids = rig.store.add_many(3)
    rig.publisher.script(ids[1], Outcome.RETURN)

    rig.relay.run_batch()

    assert "commit_prepared" not in rig.journal
    assert "ledger" not in rig.journal
    assert rig.journal[-2:] == ["rollback_prepared", "settle_failed"]
    assert list(rig.store.rows) == [ids[1]]
    row = rig.store.rows[ids[1]]
    assert row.attempts == 1
    assert row.last_error is not None and row.last_error.startswith("unroutable: 312 NO_ROUTE")


def test_returned_message_settles_confirmed_rows_as_delivered(rig: Rig) -> None:
    ids = rig.store.add_many(3)
    rig.publisher.script(ids[1], Outcome.RETURN)

    rig.relay.run_batch()

    settled = rig.store.called("settle_failed")[0]
    assert settled["delivered"] == [ids[0], ids[2]]
    assert list(settled["failures"]) == [ids[1]]
    assert settled["attributed"] == [ids[1]]


def test_confirmed_rows_of_a_failed_batch_are_not_republished_on_retry(rig: Rig) -> None:
    ids = rig.store.add_many(3)
    rig.publisher.script(ids[1], Outcome.RETURN, times=1)

    rig.step()
    rig.step()

    assert rig.publisher.published_ids() == [ids[0], ids[1], ids[2], ids[1]]
    assert rig.store.rows == {}
    assert rig.batches("rolled_back") == 1
    assert rig.batches("committed") == 1


def test_refused_row_is_dead_lettered_after_max_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, max_attempts=2)
    row_id = rig.store.add()
    rig.publisher.script(row_id, Outcome.RETURN)

    rig.step()
    assert rig.store.dead_letter == {}
    rig.step()

    assert rig.store.rows == {}
    assert rig.store.dead_letter[row_id].reason == "exhausted"
    assert rig.store.dead_letter[row_id].error.startswith("unroutable")
    assert rig.dead_lettered("exhausted") == 1


def test_failures_back_off_with_the_configured_delays(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, retry_base_delay=1.5, retry_max_delay=60.0, max_attempts=7)
    row_id = rig.store.add()
    rig.publisher.script(row_id, Outcome.RETURN)

    rig.relay.run_batch()

    settled = rig.store.called("settle_failed")[0]
    assert (settled["base_delay"], settled["max_delay"], settled["max_attempts"]) == (1.5, 60.0, 7)
    assert rig.store.rows[row_id].available_at == 1.5
    assert rig.relay.run_batch() == 0  # not due yet


# -- a channel closed by the broker -----------------------------------------------------------


def test_channel_closed_makes_unconfirmed_rows_suspect(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, max_attempts=1)
    ids = rig.store.add_many(3)
    rig.publisher.script(ids[1], Outcome.CLOSE_CHANNEL)

    rig.relay.run_batch()

    assert "commit_prepared" not in rig.journal
    assert sorted(rig.store.rows) == [ids[1], ids[2]]
    for row_id in ids[1:]:
        assert rig.store.rows[row_id].attempts == 1
        assert rig.store.rows[row_id].last_error == CHANNEL_CLOSED


def test_suspects_in_a_batch_of_several_are_never_dead_lettered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, max_attempts=1)
    ids = rig.store.add_many(3)
    rig.publisher.script(ids[1], Outcome.CLOSE_CHANNEL)

    rig.relay.run_batch()

    assert rig.store.called("settle_failed")[0]["attributed"] == []
    assert rig.store.dead_letter == {}
    assert rig.dead_lettered("exhausted") == 0
    assert rig.row_failures("channel_closed") == 2
    assert rig.batch_failures("row_failures") == 1


def test_suspect_alone_in_its_batch_is_dead_lettered_after_max_attempts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, max_attempts=3)
    row_id = rig.store.add()
    rig.publisher.script(row_id, Outcome.CLOSE_CHANNEL)

    rig.step()
    rig.step()
    assert rig.store.rows[row_id].attempts == 2
    assert rig.store.dead_letter == {}
    rig.step()

    assert rig.store.rows == {}
    assert rig.store.dead_letter[row_id].reason == "exhausted"
    assert rig.store.dead_letter[row_id].attempts == 3
    assert rig.dead_lettered("exhausted") == 1


def test_channel_close_culprit_is_isolated_and_the_rest_delivered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, max_attempts=2)
    ids = rig.store.add_many(4)
    rig.publisher.script(ids[1], Outcome.CLOSE_CHANNEL)

    for _ in range(6):
        rig.step()

    assert rig.store.rows == {}
    assert list(rig.store.dead_letter) == [ids[1]]
    assert sorted(m.row_id for m in rig.publisher.confirmed) == [ids[0], ids[2], ids[3]]
    assert len(rig.publisher.confirmed) == 3  # every healthy row confirmed exactly once


def test_closed_channel_is_reopened_before_the_next_batch(rig: Rig) -> None:
    row_id = rig.store.add()
    rig.publisher.script(row_id, Outcome.CLOSE_CHANNEL, times=1)
    rig.step()
    assert not rig.publisher.connected

    rig.step()

    assert rig.journal.count("amqp_connect") == 1
    assert rig.store.rows == {}
    assert rig.batches("committed") == 1


# -- exchanges that do not exist --------------------------------------------------------------


def test_missing_exchange_fails_only_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, missing={"gone"})
    ok1 = rig.store.add(exchange="events")
    bad = rig.store.add(exchange="gone")
    ok2 = rig.store.add(exchange="events")

    rig.relay.run_batch()

    assert rig.publisher.published_ids() == [ok1, ok2]
    assert "commit_prepared" not in rig.journal
    assert list(rig.store.rows) == [bad]
    failed = rig.store.rows[bad]
    assert failed.attempts == 1
    assert failed.last_error is not None
    assert failed.last_error.startswith("exchange 'gone' not found")
    assert rig.row_failures("exchange_not_found") == 1


def test_rows_of_a_missing_exchange_are_attributed(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, missing={"gone"}, max_attempts=1)
    rig.store.add(exchange="events")
    bad = rig.store.add(exchange="gone")

    rig.relay.run_batch()

    assert rig.store.called("settle_failed")[0]["attributed"] == [bad]
    assert list(rig.store.dead_letter) == [bad]


def test_suspect_alone_among_published_rows_is_attributed(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, missing={"gone"})
    rig.store.add(exchange="gone")
    culprit = rig.store.add(exchange="events")
    rig.publisher.script(culprit, Outcome.CLOSE_CHANNEL)

    rig.relay.run_batch()

    assert culprit in rig.store.called("settle_failed")[0]["attributed"]


# -- failure reasons and logs -----------------------------------------------------------------


def test_failed_and_dead_lettered_rows_are_logged_with_their_action(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    rig = make_rig(monkeypatch, max_attempts=2)
    row_id = rig.store.add()
    rig.publisher.script(row_id, Outcome.RETURN)

    with caplog.at_level(logging.WARNING, logger="relay"):
        rig.step()
        rig.step()

    actions = [getattr(r, "action", None) for r in caplog.records if getattr(r, "row_id", None)]
    assert actions == ["row_failed", "row_dead_lettered"]
