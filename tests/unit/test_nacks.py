"""What a nack costs a row (relay/worker.py, ``_settle``; issue 32), against the fakes.

A nack names the message a queue refused. The nacked row is a suspect: it counts an attempt,
backs off on its own and is retried alone; the batch's other messages are confirmed and never
sent again, and the relay goes on at once. A row nacked alone is charged (dead-lettered after
OUTBOX_MAX_ATTEMPTS) only while the broker confirms other messages.
"""

from __future__ import annotations

import pytest

from outbox_relay.relay import worker
from tests.unit.fakes import Outcome
from tests.unit.relay_rig import Rig, make_rig


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Rig:
    return make_rig(monkeypatch)


def test_a_nacked_row_is_a_suspect_and_the_rest_of_its_batch_is_delivered(rig: Rig) -> None:
    ids = rig.store.add_many(4)
    rig.publisher.script(ids[1], Outcome.NACK, times=1)

    rig.step()

    assert "commit_prepared" not in rig.journal
    assert list(rig.store.rows) == [ids[1]]  # the confirmed ones are not published again
    assert rig.store.rows[ids[1]].attempts == 1
    assert rig.store.rows[ids[1]].last_error == "nacked by the broker"
    assert rig.row_failures("nacked") == 1
    assert rig.batch_failures("row_failures") == 1
    assert rig.publisher.connected  # no reconnect, no hold-off: the next batch goes at once
    settled = rig.store.called("settle_failed")[-1]
    assert settled["attributed"] == []  # not alone: retried alone, not charged

    rig.step()
    assert rig.store.rows == {} and rig.batches("committed") == 1
    assert [m.row_id for m in rig.publisher.published] == [*ids, ids[1]]


def test_a_row_nacked_alone_while_the_broker_confirms_others_is_dead_lettered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = make_rig(monkeypatch, max_attempts=3)
    full = rig.store.add(routing_key="full.x")
    healthy = rig.store.add_many(3)
    rig.publisher.script(full, Outcome.NACK)  # a full queue: every time

    for _ in range(10):
        rig.step()
        rig.store.add()  # other traffic, confirmed between the retries
        if rig.store.dead_letter:
            break

    assert list(rig.store.dead_letter) == [full]
    dead = rig.store.dead_letter[full]
    assert dead.reason == "exhausted" and dead.attempts == 3
    assert dead.error == "nacked by the broker"
    assert rig.dead_lettered("exhausted") == 1
    assert set(healthy) <= {m.row_id for m in rig.publisher.confirmed}
    while rig.relay.run_batch():
        pass  # the other traffic flows
    assert rig.store.rows == {} and rig.publisher.confirmed[-1].row_id == max(
        m.row_id for m in rig.publisher.published)


def test_a_broker_that_confirms_nothing_never_runs_rows_out_of_attempts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nacks while no other message is confirmed may be the broker failing as a whole: the rows
    count attempts and back off, but none is dead-lettered, however long it lasts."""
    monkeypatch.setattr(worker, "NACK_EVIDENCE_SECONDS", -1.0)  # no ack is ever recent
    rig = make_rig(monkeypatch, batch_size=5, max_attempts=2)
    ids = rig.store.add_many(5)
    for row_id in ids:
        rig.publisher.script(row_id, Outcome.NACK, times=6)

    for _ in range(40):  # 30 nacks, 5 confirms, and 5 claims that find nothing
        rig.step()

    assert rig.store.dead_letter == {}
    assert rig.store.rows == {}  # every row published once the broker stopped nacking
    assert rig.batches("committed") == 5  # then each alone: they had attempts
    assert rig.row_failures("nacked") == 30


def test_a_nack_storm_costs_each_row_one_attempt(rig: Rig) -> None:
    """Every message of a batch nacked (a channel opened right after a quorum queue's leader
    died, RabbitMQ 3.10): each row counts one attempt and is published on the next channel."""
    ids = rig.store.add_many(4)
    for row_id in ids:
        rig.publisher.script(row_id, Outcome.NACK, times=1)

    rig.step()
    assert {r.attempts for r in rig.store.rows.values()} == {1}
    assert rig.store.called("settle_failed")[-1]["attributed"] == []

    for _ in range(4):
        rig.step()
    assert rig.store.rows == {} and rig.store.dead_letter == {}
    assert rig.batches("committed") == 4


def test_a_nacked_ledger_record_charges_no_row(rig: Rig) -> None:
    from outbox_relay.errors import BatchFailed

    ids = rig.store.add_many(2)
    rig.publisher.fail("record_batch", BatchFailed("ledger record not confirmed: nacked by the "
                                                   "broker"), disconnect=False)

    rig.step()

    assert sorted(rig.store.rows) == []  # confirmed: forgotten, not published again
    assert rig.batch_failures("ledger") == 1 and rig.row_failures("nacked") == 0
    assert [m.row_id for m in rig.publisher.published] == ids
