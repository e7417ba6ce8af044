"""The next batch claimed while this one is confirmed (outbox_relay.relay.worker.Relay on the
fakes): never prepared before this one is finished, freed on a fault, built while the
confirms are awaited, its size after keys in flight, and the claim's byte budget."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from outbox_relay.errors import ConnectionLost, DatabaseError
from outbox_relay.relay import worker
from tests.unit.fakes import Outcome
from tests.unit.relay_rig import Crash, Rig, deep, make_rig, strip_faults

# -- the next batch claimed while this one is confirmed ---------------------------------------


def test_next_batch_is_claimed_during_the_confirms_and_published_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    rig.store.add_many(4)

    assert rig.relay.run_batch() == 2
    # Claimed, not prepared: only this batch was ever in doubt.
    assert rig.store.open is not None and sorted(rig.store.open.claimed) == [3, 4]
    assert rig.store.prepared == {}
    rig.journal.clear()
    assert rig.relay.run_batch() == 2

    assert strip_faults(rig.journal) == [
        "missing_exchanges", "prepare", "publish", "claim", "rollback", "ledger",
        "commit_prepared"]
    assert rig.publisher.published_ids() == [1, 2, 3, 4]
    assert rig.store.rows == {} and rig.store.open is None


def test_a_crash_during_the_confirms_leaves_one_batch_in_doubt_and_the_next_unprepared(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2, crash_at="after_publish")
    rig.store.add_many(4)

    with pytest.raises(Crash):
        rig.relay.run_batch()

    assert list(rig.store.prepared) == [rig.gid(1)]
    assert rig.decision == (rig.gid(1), False)
    # The claim made ahead is an open transaction: the dying session rolls it back.
    assert rig.store.open is not None and sorted(rig.store.open.claimed) == [3, 4]


def test_a_failed_claim_ahead_is_raised_once_this_batch_is_committed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    rig.store.add_many(4)
    rig.store.before("claim", lambda: None)
    rig.store.before("claim", lambda: rig.store.fail(
        "claim", psycopg.DatabaseError("canceling statement"), disconnect=False))

    with pytest.raises(DatabaseError, match="canceling statement"):
        rig.relay.run_batch()

    assert rig.store.called("finish") == [{"gid": rig.gid(1), "commit": True}]
    assert rig.store.prepared == {} and rig.relay.unfinished is None
    assert rig.relay.claimed_ahead == []
    assert sorted(rig.store.rows) == [3, 4]


def test_a_claim_ahead_behind_a_whole_table_request_gives_up_and_is_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A compaction's VACUUM FULL queued for the table: the claim ahead gives up its lock
    # wait (relay/store.py, AHEAD_LOCK_WAIT); this batch finishes, the next claims normally.
    rig = make_rig(monkeypatch, batch_size=2)
    rig.store.add_many(4)
    rig.store.whole_table_requested = True

    assert rig.relay.run_batch() == 2

    assert rig.batches("committed") == 1 and rig.relay.claimed_ahead == []
    assert rig.store.open is None and sorted(rig.store.rows) == [3, 4]
    assert rig.metric("outbox_relay_claims_ahead_given_up_total") == 1
    rig.store.whole_table_requested = False
    assert rig.relay.run_batch() == 2
    assert rig.publisher.published_ids() == [1, 2, 3, 4]
    assert rig.metric("outbox_relay_claims_ahead_given_up_total") == 1


def test_a_failed_batch_keeps_the_claim_made_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    ids = rig.store.add_many(4)
    rig.publisher.script(ids[0], Outcome.RETURN, times=1)

    rig.relay.run_batch()
    rig.relay.run_batch()

    assert rig.batches("rolled_back") == 1 and rig.batches("committed") == 1
    assert rig.publisher.published_ids() == [1, 2, 3, 4]
    # The returned row came back with an attempt counted; the second batch claimed it ahead, alone.
    assert rig.store.rows == {}
    assert rig.store.open is not None and list(rig.store.open.claimed) == [ids[0]]
    assert rig.store.open.claimed[ids[0]].attempts == 1


def test_no_claim_ahead_once_asked_to_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    rig.store.add_many(4)
    rig.shutdown.predicate = lambda: True

    rig.relay.run_batch()

    assert len(rig.store.called("claim")) == 1
    assert rig.store.open is None


def test_a_connection_fault_forgets_the_claim_made_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    rig.store.add_many(4)
    rig.relay.run_batch()
    assert rig.relay.claimed_ahead

    rig.relay.on_fault(ConnectionLost("server closed the connection"))

    assert rig.relay.claimed_ahead == []
    assert rig.store.open is None  # closed with the session: the rows are free again
    assert sorted(rig.store.rows) == [3, 4]


def test_a_lost_broker_frees_the_claim_made_ahead_before_reconnecting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    ids = rig.store.add_many(4)
    # The broker goes away while the first batch waits for its confirms, the next one claimed.
    rig.publisher.script(ids[0], Outcome.TIMEOUT, times=1)
    rig.relay.run_batch()
    assert rig.batches("rolled_back") == 1 and rig.relay.claimed_ahead
    assert not rig.publisher.connected
    open_while_reconnecting: list[object] = []
    rig.publisher.before("connect", lambda: open_while_reconnecting.append(rig.store.open))

    rig.relay.ensure_connected()

    # Nothing stays claimed in an open transaction while the relay waits for the broker.
    assert open_while_reconnecting == [None]
    # Back in the outbox: the unconfirmed row and the two claimed ahead (row 2 was confirmed).
    assert rig.relay.claimed_ahead == [] and sorted(rig.store.rows) == [ids[0], *ids[2:]]


# -- building the batch claimed ahead ---------------------------------------------------------


def test_a_bad_row_in_the_batch_claimed_ahead_is_handled_in_its_own_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    first = rig.store.add_many(2)
    bad = rig.store.add(headers=deep(100_000))
    last = rig.store.add()

    rig.relay.run_batch()  # claims [bad, last] ahead, after this batch's PREPARE
    assert [r.id for r in rig.relay.claimed_ahead] == [bad, last]
    rig.relay.run_batch()

    assert rig.publisher.published_ids() == [*first, last]
    assert list(rig.store.dead_letter) == [bad]
    assert rig.batches("committed") == 2


def test_the_batch_claimed_ahead_is_built_while_the_confirms_are_awaited(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    ids = rig.store.add_many(4)
    built: list[tuple[int, bool]] = []  # (row, built while the last batch was prepared)
    real = worker.to_message
    monkeypatch.setattr(worker, "to_message", lambda row, **kw: (
        built.append((row.id, bool(rig.store.prepared))), real(row, **kw))[1])

    rig.relay.run_batch()
    rig.relay.run_batch()

    assert built == [(ids[0], False), (ids[1], False), (ids[2], True), (ids[3], True)]
    assert rig.publisher.published_ids() == ids and rig.batches("committed") == 2


def test_an_error_building_ahead_fails_the_next_batch_not_the_one_in_flight(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    ids = rig.store.add_many(4)
    real = worker.to_message

    def broken_for_later_rows(row: Any, **kw: Any) -> Any:
        if row.id > ids[1]:
            raise RuntimeError("a bug in building")
        return real(row, **kw)

    monkeypatch.setattr(worker, "to_message", broken_for_later_rows)
    rig.relay.run_batch()
    assert rig.batches("committed") == 1 and rig.publisher.published_ids() == ids[:2]

    with pytest.raises(RuntimeError, match="a bug in building"):
        rig.relay.run_batch()  # built again before its PREPARE: nothing prepared, nothing sent
    assert rig.store.prepared == {} and rig.publisher.published_ids() == ids[:2]


def test_a_batch_built_ahead_is_built_again_for_another_frame_max(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    first = rig.store.add_many(2)
    big = rig.store.add(headers={"big": "x" * 5000})
    last = rig.store.add()
    rig.relay.run_batch()  # claims [big, last] ahead and builds them for frame_max 131072
    assert [r.id for r in rig.relay.claimed_ahead] == [big, last]

    rig.publisher.negotiated_frame_max = 4096  # a reconnect to a broker with a smaller one
    rig.relay.run_batch()

    assert rig.publisher.published_ids() == [*first, last]
    assert "frame_max of 4096" in rig.store.dead_letter[big].error


def test_an_empty_claim_ahead_lends_nothing_to_the_next_batch(rig: Rig) -> None:
    ids = rig.store.add_many(2)
    # A claim ahead that found nothing, its (empty) build for the frame_max in force.
    rig.relay._ahead = worker.Ahead([], built=([], []), frame_max=rig.publisher.frame_max)

    rig.relay.run_batch()

    assert rig.publisher.published_ids() == ids and rig.batches("committed") == 1


# -- how many rows the claim ahead asks for ---------------------------------------------------


def test_a_claim_ahead_held_back_by_keys_in_flight_asks_for_less_then_doubles_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=8)
    for _ in range(2):  # the second row of each key waits for the first one's batch
        for key in range(8):
            rig.store.add(ordering_key=f"k{key}")
    rig.relay.run_batch()  # the claim ahead finds every key's head in flight: nothing
    rig.relay.run_batch()  # the second rows; the claim ahead finds an empty outbox
    rig.store.add_many(20)  # rows without a key
    for _ in range(4):
        rig.relay.run_batch()

    limits = [c["limit"] for c in rig.store.called("claim")]
    # (batch, then its claim ahead): a claim that is not made ahead always asks for a batch.
    assert limits == [8, 8, 8, 1, 8, 1, 2, 4, 8]
    published = rig.publisher.published_ids()
    assert len(published) == 31 and len(rig.relay.claimed_ahead) == 5  # the last 5 rows


def test_an_empty_claim_ahead_behind_rows_without_a_key_still_asks_for_a_batch(
        rig: Rig) -> None:
    rig.store.add_many(3)

    rig.relay.run_batch()  # the claim ahead finds nothing: the outbox is empty
    rig.store.add_many(15)
    rig.relay.run_batch()
    rig.relay.run_batch()

    assert [c["limit"] for c in rig.store.called("claim")] == [10, 10, 10, 10, 10]


# -- the byte budget (issue 10) ---------------------------------------------------------------


def test_a_batch_stops_at_its_byte_budget_but_takes_one_row_at_least(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=10, batch_max_bytes=2500, max_message_bytes=5000)
    big = rig.store.add(payload_bytes=b"x" * 4000)  # alone over the budget: taken alone
    rest = rig.store.add_many(4, payload_bytes=b"y" * 1000)

    rig.relay.run_batch()

    assert rig.publisher.batches[0] == [m for m in rig.publisher.batches[0] if m.row_id == big]
    claims = rig.store.called("claim")
    assert claims[0]["max_bytes"] == 2500
    assert len(claims) == 1  # the batch used up the budget: nothing claimed ahead
    rig.relay.run_batch()
    assert [m.row_id for m in rig.publisher.batches[1]] == rest[:2]


def test_the_batch_claimed_ahead_gets_what_is_left_of_the_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2, batch_max_bytes=10_000, max_message_bytes=5000)
    ids = rig.store.add_many(4, payload_bytes=b"z" * 1000)
    first_batch_bytes = sum(rig.store.rows[i].claimed().row_bytes for i in ids[:2])

    rig.relay.run_batch()

    _first, ahead = rig.store.called("claim")
    assert first_batch_bytes > 2000
    assert ahead["max_bytes"] == 10_000 - first_batch_bytes
