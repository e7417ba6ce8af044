"""A batch through the protocol's five steps (outbox_relay.relay.worker.Relay on the fakes of
fakes.py): their order, the gid, the signed ledger record, the metrics; an empty claim; a
batch whose messages do not match its rows."""

from __future__ import annotations

import json

import pytest

from outbox_relay import ledger
from tests.unit.fakes import LedgerRecord
from tests.unit.relay_rig import Rig, make_rig, strip_faults

# -- a clean batch ----------------------------------------------------------------------------


def test_clean_batch_commits_after_the_ledger_record_in_protocol_order(rig: Rig) -> None:
    rig.store.add_many(3)

    assert rig.relay.run_batch() == 3

    # The second claim is the next batch's, made while the broker confirms: it found nothing.
    assert strip_faults(rig.journal) == [
        "claim", "missing_exchanges", "prepare", "publish", "claim", "rollback", "ledger",
        "commit_prepared"]


def test_clean_batch_empties_the_outbox_and_leaves_no_prepared_transaction(rig: Rig) -> None:
    rig.store.add_many(3)

    rig.relay.run_batch()

    assert rig.store.rows == {}
    assert rig.store.prepared == {}
    assert rig.store.open is None
    assert rig.relay.unfinished is None


def test_clean_batch_publishes_rows_in_id_order_with_their_message_ids(rig: Rig) -> None:
    ids = [rig.store.add(message_id=f"evt-{n}") for n in range(3)]

    rig.relay.run_batch()

    assert rig.publisher.published_ids() == ids
    assert [m.message_id for m in rig.publisher.published] == ["evt-0", "evt-1", "evt-2"]
    assert [m.properties.message_id for m in rig.publisher.published] == ["evt-0", "evt-1", "evt-2"]


def test_ledger_record_names_the_prepared_gid_the_count_and_the_instance(rig: Rig) -> None:
    rig.store.add_many(2)

    rig.relay.run_batch()

    prepared_gid = rig.store.called("prepare")[0]["gid"]
    assert prepared_gid == "outbox:00000abc:1"
    xid = rig.store.xids[prepared_gid]
    assert rig.publisher.ledger == [LedgerRecord(prepared_gid, 2, "00000abc", xid)]
    assert rig.store.called("finish") == [{"gid": prepared_gid, "commit": True}]


def test_ledger_record_is_signed_with_the_key_and_names_xid_and_database(rig: Rig) -> None:
    rig.store.add()

    rig.relay.run_batch()

    (record,) = rig.publisher.records
    gid = rig.gid(1)
    assert (record["xid"], record["database"]) == (rig.store.xids[gid], "fake")
    expected = ledger.batch_record(rig.store.ledger_key, gid=gid, xid=record["xid"],
                                   database="fake", count=1, relay="00000abc")
    assert record == json.loads(expected)
    forged = ledger.batch_record(b"x" * 32, gid=gid, xid=record["xid"], database="fake",
                                 count=1, relay="00000abc")
    assert json.loads(forged)["mac"] != record["mac"]


def test_each_batch_gets_a_new_gid_with_the_next_sequence(rig: Rig) -> None:
    rig.store.add_many(3)

    for _ in range(3):
        rig.step()
        rig.store.add()

    assert [c["gid"] for c in rig.store.called("prepare")] == [rig.gid(1), rig.gid(2), rig.gid(3)]


def test_claim_asks_for_the_configured_batch_size(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    rig.store.add_many(5)

    assert rig.relay.run_batch() == 2

    # This batch, and the next with what this one left of the byte budget.
    assert [c["limit"] for c in rig.store.called("claim")] == [2, 2]
    assert sorted(rig.store.rows) == [5]


def test_missing_exchanges_is_asked_once_with_the_batch_exchanges(rig: Rig) -> None:
    rig.store.add(exchange="a")
    rig.store.add(exchange="b")
    rig.store.add(exchange="a")

    rig.relay.run_batch()

    assert rig.publisher.exchange_checks == [{"a", "b"}]


def test_clean_batch_moves_the_metrics(rig: Rig) -> None:
    rig.store.add_many(4)

    rig.relay.run_batch()

    assert rig.metric("outbox_relay_events_published_total") == 4
    assert rig.batches("committed") == 1
    assert rig.batches("rolled_back") == 0
    assert rig.metric("outbox_relay_batch_size_events_count") == 1
    assert rig.metric("outbox_relay_batch_size_events_sum") == 4
    assert rig.metric("outbox_relay_batch_duration_seconds_count") == 1


# -- an empty claim ---------------------------------------------------------------------------


def test_empty_claim_rolls_back_and_prepares_nothing(rig: Rig) -> None:
    assert rig.relay.run_batch() == 0

    assert rig.journal == ["claim", "rollback"]
    assert rig.store.prepared == {}
    assert rig.store.open is None
    assert rig.publisher.batches == []
    assert rig.faults == []


def test_empty_claim_counts_no_batch(rig: Rig) -> None:
    rig.relay.run_batch()

    assert rig.batches("committed") == rig.batches("rolled_back") == 0
    assert rig.metric("outbox_relay_batch_size_events_count") == 0


def test_rows_not_yet_due_are_not_claimed(rig: Rig) -> None:
    rig.store.add(available_at=10.0)

    assert rig.relay.run_batch() == 0

    assert list(rig.store.rows) == [1]


# -- a batch that would lose a row ------------------------------------------------------------


def test_a_batch_that_would_lose_a_row_is_stopped_before_its_prepare(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=3)
    ids = rig.store.add_many(3)
    real = rig.relay._build
    monkeypatch.setattr(rig.relay, "_build", lambda rows: real(rows[1:]))  # a bug drops a row

    with pytest.raises(RuntimeError, match="3 rows claimed, 2 messages"):
        rig.relay.run_batch()
    assert rig.store.prepared == {} and rig.publisher.published_ids() == []
    rig.relay.store.rollback()  # what the loop's reset does
    assert sorted(rig.store.rows) == ids
