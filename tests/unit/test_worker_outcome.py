"""The outcome of a prepared batch (outbox_relay.relay.worker.Relay on the fakes): COMMIT or
ROLLBACK PREPARED, a decision kept across a lost connection and applied after reconnecting, a
batch finished elsewhere, and the decision left at each crash point."""

from __future__ import annotations

import psycopg
import pytest

from outbox_relay.errors import ConnectionLost, DatabaseError, TransientError
from tests.unit.fakes import Outcome
from tests.unit.relay_rig import Crash, Rig, make_rig

# -- finishing the prepared transaction -------------------------------------------------------


def test_postgres_lost_during_commit_prepared_keeps_the_commit_decision(rig: Rig) -> None:
    rig.store.add_many(2)
    rig.store.fail("finish", psycopg.OperationalError("server closed the connection unexpectedly"))

    with pytest.raises(TransientError, match="PostgreSQL connection lost finishing outbox:00000abc:1"):
        rig.relay.run_batch()

    assert rig.decision == (rig.gid(1), True)
    assert list(rig.store.prepared) == [rig.gid(1)]
    assert rig.batches("committed") == 0


def test_commit_decision_is_applied_after_reconnecting(rig: Rig) -> None:
    rig.store.add_many(2)
    rig.store.fail("finish", psycopg.OperationalError("server closed the connection unexpectedly"))
    with pytest.raises(TransientError):
        rig.relay.run_batch()
    rig.journal.clear()

    rig.relay.ensure_connected()

    assert rig.journal == ["pg_connect", "commit_prepared"]
    assert rig.store.prepared == {}
    assert rig.store.rows == {}
    assert rig.relay.unfinished is None
    assert rig.batches("committed") == 1


def test_postgres_lost_during_rollback_prepared_applies_the_rollback_later(rig: Rig) -> None:
    ids = rig.store.add_many(2)
    rig.publisher.script(ids[0], Outcome.RETURN, times=1)
    rig.store.fail("finish", psycopg.OperationalError("terminating connection"))

    with pytest.raises(TransientError):
        rig.relay.run_batch()
    assert rig.decision == (rig.gid(1), False)
    rig.relay.ensure_connected()

    assert rig.store.called("finish")[-1] == {"gid": rig.gid(1), "commit": False}
    assert sorted(rig.store.rows) == ids
    assert rig.store.prepared == {}


def test_commit_whose_reply_was_lost_counts_as_finished_elsewhere(rig: Rig) -> None:
    rig.store.add_many(2)
    rig.store.fail("finish", psycopg.OperationalError("connection lost"), apply=True)
    with pytest.raises(TransientError):
        rig.relay.run_batch()

    rig.relay.ensure_connected()

    assert rig.store.rows == {}
    assert rig.relay.unfinished is None
    assert rig.batches("finished_elsewhere") == 1


def test_non_connection_database_error_in_finish_is_raised_as_is(rig: Rig) -> None:
    rig.store.add()
    rig.store.fail("finish", psycopg.errors.InsufficientPrivilege("permission denied"))

    with pytest.raises(DatabaseError, match="permission denied"):
        rig.relay.run_batch()

    assert rig.decision == (rig.gid(1), True)


def test_finish_returning_false_is_counted_as_finished_elsewhere(rig: Rig) -> None:
    rig.store.add_many(2)
    rig.store.before("finish", lambda: rig.store.resolve_elsewhere(commit=True))

    rig.relay.run_batch()

    assert rig.batches("finished_elsewhere") == 1
    assert rig.batches("committed") == 0
    assert rig.relay.unfinished is None
    assert rig.store.rows == {}


def test_rollback_finished_elsewhere_still_settles_the_failures(rig: Rig) -> None:
    ids = rig.store.add_many(2)
    rig.publisher.script(ids[1], Outcome.RETURN)
    rig.store.before("finish", lambda: rig.store.resolve_elsewhere(commit=False))

    rig.relay.run_batch()

    assert rig.batches("finished_elsewhere") == 1
    assert list(rig.store.rows) == [ids[1]]
    assert rig.store.rows[ids[1]].attempts == 1


def test_batch_prepared_when_the_connection_dropped_is_finished_after_reconnecting(rig: Rig) -> None:
    rig.store.add_many(2)
    rig.store.fail("prepare", psycopg.OperationalError("connection lost"), apply=True)
    with pytest.raises(ConnectionLost):
        rig.relay.run_batch()

    rig.relay.ensure_connected()

    assert rig.store.prepared == {}
    assert sorted(rig.store.rows) == [1, 2]


def test_prepare_refused_by_the_server_leaves_nothing_to_finish(rig: Rig) -> None:
    """E.g. max_prepared_transactions reached: nothing was prepared, so no ROLLBACK PREPARED
    (and no "finished elsewhere") follows; the open claim is rolled back and the rows stay."""
    rig.store.add_many(2)
    rig.store.fail("prepare", psycopg.errors.OutOfMemory("maximum number of prepared "
                                                         "transactions reached"), disconnect=False)
    with pytest.raises(DatabaseError, match="maximum number"):
        rig.relay.run_batch()

    assert rig.relay.unfinished is None
    rig.relay.on_fault(DatabaseError("again", sqlstate="53200"))
    rig.relay.ensure_connected()

    assert rig.store.called("finish") == []
    assert rig.batches("finished_elsewhere") == 0
    assert sorted(rig.store.rows) == [1, 2]


# -- crash points -----------------------------------------------------------------------------


def test_crash_points_are_passed_in_protocol_order(rig: Rig) -> None:
    rig.store.add()

    rig.relay.run_batch()

    assert rig.journal == [
        "claim", "@after_claim", "missing_exchanges", "prepare", "@after_prepare", "publish",
        "claim", "rollback", "@after_publish", "ledger", "@after_ledger", "commit_prepared",
        "@after_commit"]


def test_failed_batch_passes_only_the_crash_points_before_publishing(rig: Rig) -> None:
    row_id = rig.store.add()
    rig.publisher.script(row_id, Outcome.RETURN)

    rig.relay.run_batch()

    assert rig.faults == ["after_claim", "after_prepare"]


@pytest.mark.parametrize(("point", "commit"), [
    ("after_prepare", False), ("after_publish", False), ("after_ledger", True)])
def test_interruption_at_a_crash_point_leaves_the_right_decision(
        monkeypatch: pytest.MonkeyPatch, point: str, commit: bool) -> None:
    rig = make_rig(monkeypatch, crash_at=point)
    rig.store.add_many(2)

    with pytest.raises(Crash):
        rig.relay.run_batch()
    assert rig.decision == (rig.gid(1), commit)
    rig.relay.ensure_connected()

    assert rig.store.called("finish")[-1] == {"gid": rig.gid(1), "commit": commit}
    assert (rig.store.rows == {}) is commit


def test_interruption_after_claim_leaves_no_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, crash_at="after_claim")
    rig.store.add()

    with pytest.raises(Crash):
        rig.relay.run_batch()

    assert rig.relay.unfinished is None
    assert rig.store.prepared == {}
