"""Batches that fail through no row's fault (outbox_relay.relay.worker.Relay on the fakes): a
nack, a lost connection, a confirm timeout, a ledger record not confirmed, a deleted ledger.
The batch is rolled back and its rows count no attempt, until lost connections in a row
point at a row."""

from __future__ import annotations

import pytest

from outbox_relay.errors import BatchFailed, LedgerMissing, TransientError
from tests.unit.fakes import Outcome
from tests.unit.relay_rig import Rig, make_rig

# -- nacks ------------------------------------------------------------------------------------


def test_nacks_never_dead_letter_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, max_attempts=2)
    row_id = rig.store.add()
    rig.publisher.script(row_id, Outcome.NACK, times=5)

    for _ in range(6):
        rig.step()

    assert rig.store.dead_letter == {}
    assert rig.store.rows == {}  # published once the broker stopped nacking
    assert rig.batches("committed") == 1


# -- connection loss and other transient results ----------------------------------------------


def test_connection_loss_rolls_back_and_counts_no_attempts(rig: Rig) -> None:
    ids = rig.store.add_many(3)
    rig.publisher.script(ids[1], Outcome.LOSE_CONNECTION, times=1)

    rig.relay.run_batch()

    assert "commit_prepared" not in rig.journal
    assert "rollback_prepared" in rig.journal
    assert sorted(rig.store.rows) == [ids[1], ids[2]]
    assert all(r.attempts == 0 and r.last_error is None for r in rig.store.rows.values())
    assert rig.store.called("settle_failed")[0]["failures"] == {}
    assert rig.batch_failures("connection_lost") == 1
    assert rig.batch_failures("row_failures") == 0
    assert sum(rig.row_failures(r) for r in ("unroutable", "nacked", "channel_closed")) == 0
    assert rig.batches("rolled_back") == 1


def test_confirm_timeout_rolls_back_and_counts_no_attempts(rig: Rig) -> None:
    ids = rig.store.add_many(2)
    rig.publisher.script(ids[0], Outcome.TIMEOUT, times=1)

    rig.relay.run_batch()

    assert rig.store.rows[ids[0]].attempts == 0
    assert ids[1] not in rig.store.rows  # confirmed: delivered, forgotten
    assert rig.batch_failures("confirm_timeout") == 1
    assert rig.store.dead_letter == {}


def test_rows_of_a_lost_connection_go_out_after_reconnecting(rig: Rig) -> None:
    ids = rig.store.add_many(2)
    rig.publisher.script(ids[0], Outcome.LOSE_CONNECTION, times=1)

    rig.step()
    rig.step()

    assert rig.store.rows == {}
    assert [m.row_id for m in rig.publisher.confirmed] == ids
    assert rig.journal.count("amqp_connect") == 1


# -- the ledger record ------------------------------------------------------------------------


@pytest.mark.parametrize("error", [BatchFailed("ledger record not confirmed: nacked"),
                                   TransientError("RabbitMQ connection lost")])
def test_ledger_failure_rolls_back_and_never_commits(rig: Rig, error: Exception) -> None:
    rig.store.add_many(2)
    rig.publisher.fail("record_batch", error)

    rig.relay.run_batch()

    assert "commit_prepared" not in rig.journal
    assert rig.journal[rig.journal.index("ledger") + 1] == "rollback_prepared"
    assert rig.batches("rolled_back") == 1
    assert rig.batch_failures("ledger") == 1
    assert rig.metric("outbox_relay_events_published_total") == 0


def test_ledger_failure_counts_no_attempts_and_forgets_confirmed_rows(rig: Rig) -> None:
    ids = rig.store.add_many(2)
    rig.publisher.fail("record_batch", BatchFailed("ledger record not confirmed"))

    rig.relay.run_batch()

    settled = rig.store.called("settle_failed")[0]
    assert settled["delivered"] == ids
    assert settled["failures"] == {}


def test_unexpected_ledger_error_leaves_the_rollback_decision(rig: Rig) -> None:
    rig.store.add_many(2)
    rig.publisher.fail("record_batch", RuntimeError("bug"))

    with pytest.raises(RuntimeError):
        rig.relay.run_batch()
    assert rig.decision == (rig.gid(1), False)
    rig.relay.ensure_connected()

    assert "commit_prepared" not in rig.journal
    assert rig.journal[-1] == "rollback_prepared"
    assert sorted(rig.store.rows) == [1, 2]


def test_deleted_ledger_pauses_claiming_until_it_is_declared_again(rig: Rig) -> None:
    rig.store.add_many(3)
    rig.publisher.fail("record_batch", LedgerMissing("ledger stream 'outbox.ledger' is gone"))

    rig.step()

    assert rig.batches("rolled_back") == 1
    assert rig.metric("outbox_relay_ledger_missing_total") == 1
    assert not rig.publisher.connected  # dropped: the next turn declares the ledger first
    later = rig.store.add_many(2)
    rig.journal.clear()
    rig.step()
    assert rig.journal.index("amqp_connect") < rig.journal.index("claim")
    assert rig.batches("committed") == 1
    assert {m.row_id for m in rig.publisher.confirmed} >= set(later)


# -- failures in a row ------------------------------------------------------------------------


def test_lost_connections_in_a_row_count_an_attempt_for_every_unconfirmed_row(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=5, max_attempts=3)
    ids = rig.store.add_many(5)
    poison = ids[2]
    rig.publisher.script(poison, Outcome.LOSE_CONNECTION)  # always

    for _ in range(2):
        rig.step()
    assert all(r.attempts == 0 for r in rig.store.rows.values())  # twice: maybe the network
    rig.step()
    third = rig.store.called("settle_failed")[-1]
    assert set(third["failures"]) == {poison, ids[3], ids[4]}  # unconfirmed ones
    assert third["attributed"] == []  # not yet anyone's own fault

    for _ in range(40):
        if not rig.store.rows and not rig.relay.claimed_ahead:
            break
        rig.step()

    assert rig.store.rows == {}
    assert list(rig.store.dead_letter) == [poison]
    assert rig.store.dead_letter[poison].reason == "exhausted"
    assert "batches in a row" in rig.store.dead_letter[poison].error
    assert {m.row_id for m in rig.publisher.confirmed} == set(ids) - {poison}


def test_confirm_timeouts_in_a_row_never_count_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broker without a majority neither confirms nor nacks: however long that lasts, no
    row runs out of attempts."""
    rig = make_rig(monkeypatch, batch_size=5, max_attempts=2)
    ids = rig.store.add_many(5)
    rig.publisher.script(ids[2], Outcome.TIMEOUT, times=8)

    for _ in range(12):
        rig.step()

    assert rig.store.dead_letter == {}
    assert all(r.attempts == 0 for r in rig.store.rows.values())


def test_a_committed_batch_resets_the_lost_connection_streak(rig: Rig) -> None:
    flaky = rig.store.add()
    rig.publisher.script(flaky, Outcome.LOSE_CONNECTION, times=2)
    rig.step()
    rig.step()
    rig.step()  # commits, and so ends the streak
    other = rig.store.add()
    rig.publisher.script(other, Outcome.LOSE_CONNECTION, times=1)

    rig.step()

    assert rig.store.rows[other].attempts == 0
