"""Per-key order in the relay loop (relay/waves.py, relay/worker.py) against the fakes."""

from __future__ import annotations

import pytest

from outbox_relay.model import Message, OutboxRow
from outbox_relay.relay.waves import held_back, waves
from tests.unit.fakes import Outcome
from tests.unit.relay_rig import Rig, make_rig


def message(row_id: int, key: str | None, routing_key: str = "r") -> Message:
    return Message(row_id, f"m-{row_id}", "events", routing_key, b"{}", None, key)


def row(row_id: int, key: str | None) -> OutboxRow:
    return OutboxRow(row_id, f"m-{row_id}", "events", "r", key, b"{}", True, "{}", None, 0.0,
                     "", 0)


def test_a_keys_nth_message_goes_in_wave_n() -> None:
    batch = [message(1, "a"), message(2, None), message(3, "a", "other"), message(4, "b"),
             message(5, "a", "other"), message(6, None), message(7, "a"), message(8, "b")]
    assert [[m.row_id for m in wave] for wave in waves(batch)] == [
        [1, 2, 4, 6], [3, 8], [5], [7]]


def test_a_batch_in_which_no_key_repeats_is_one_wave() -> None:
    batch = [message(n, None if n % 3 == 0 else f"k{n}", f"r{n % 7}") for n in range(100)]
    assert [[m.row_id for m in wave] for wave in waves(batch[::-1])] == [list(range(100))]
    assert waves([]) == []


def test_held_back_are_the_newer_messages_of_a_stopped_key_only() -> None:
    batch = [message(2, "a"), message(3, "a"), message(4, "b"), message(5, None)]
    assert [m.row_id for m in held_back(batch, [row(1, "a")])] == [2, 3]
    assert held_back(batch, [row(3, None)]) == []
    assert [m.row_id for m in held_back(batch, [row(2, "a")])] == [3]


def test_the_next_wave_goes_out_only_after_the_last_is_confirmed(rig: Rig) -> None:
    ids = [rig.store.add(ordering_key=key, routing_key=route) for key, route in
           (("a", "x"), ("a", "y"), ("b", "x"), (None, "y"), ("a", "x"))]

    rig.relay.run_batch()

    assert [[m.row_id for m in b] for b in rig.publisher.batches[:3]] == [
        [ids[0], ids[2], ids[3]], [ids[1]], [ids[4]]]
    assert rig.store.rows == {} and rig.batches("committed") == 1


def test_a_nacked_message_keeps_the_next_one_of_its_key_unsent(rig: Rig) -> None:
    # A quorum queue regaining its majority nacked messages of a batch and confirmed later
    # ones (RabbitMQ 3.10, the cluster chaos run): a key's next message must not be
    # on its way while its older one may still be nacked. The other keys go on.
    a1, b1, a2, b2 = (rig.store.add(ordering_key=key) for key in "abab")
    rig.publisher.script(a1, Outcome.NACK, times=1)

    rig.relay.run_batch()

    assert [m.row_id for m in rig.publisher.published] == [a1, b1, b2]  # a2 never sent
    # b1 and b2 were confirmed: forgotten, not published again; a1 waits for its retry.
    assert rig.batches("rolled_back") == 1 and sorted(rig.store.rows) == [a1, a2]
    assert rig.store.rows[a1].attempts == 1 and rig.store.rows[a2].attempts == 0
    rig.relay.run_batch()  # the retry, alone
    rig.relay.run_batch()  # then the rest of its key
    assert [m.row_id for m in rig.publisher.published][3:] == [a1, a2]
    assert rig.store.rows == {}


def test_a_refused_row_holds_back_its_key_while_other_keys_flow(rig: Rig) -> None:
    a1, b1, a2, b2, a3 = (rig.store.add(ordering_key=key, routing_key=f"r{n}")
                          for n, key in enumerate("ababa"))
    rig.publisher.script(a1, Outcome.RETURN, times=1)
    rig.store.now = 0.0

    rig.relay.run_batch()  # wave 0: a1 returned, b1 confirmed; wave 1: b2 (a2 waits)

    assert [m.row_id for m in rig.publisher.published] == [a1, b1, b2]
    assert rig.store.rows[a1].attempts == 1 and sorted(rig.store.rows) == [a1, a2, a3]
    # a1 waits for its retry: a2, a3 wait behind it.
    rig.store.rows[a1].available_at = 100.0
    assert rig.relay.run_batch() == 0
    assert sorted(rig.store.rows) == [a1, a2, a3]

    rig.store.now = 100.0
    rig.relay.run_batch()  # the retry, alone
    rig.relay.run_batch()  # then the rest of its key, in order
    assert [m.row_id for m in rig.publisher.published][3:] == [a1, a2, a3]
    assert rig.store.rows == {}


def test_a_dead_lettered_row_holds_back_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, max_attempts=1)
    a1, b1, a2 = (rig.store.add(ordering_key=key, routing_key=f"r{n}")
                  for n, key in enumerate("aba"))
    rig.publisher.script(a1, Outcome.RETURN)

    rig.relay.run_batch()
    rig.relay.run_batch()

    assert a1 in rig.store.dead_letter
    assert [m.row_id for m in rig.publisher.published] == [a1, b1]
    assert list(rig.store.rows) == [a2]  # never claimed while the dead letter is there
    assert rig.relay.run_batch() == 0


def test_an_unpublishable_row_with_newer_rows_of_its_key_is_set_aside_first(rig: Rig) -> None:
    bad = rig.store.add(ordering_key="a", headers=["not", "an", "object"])
    later = rig.store.add(ordering_key="a")
    other = rig.store.add(ordering_key="b")

    rig.relay.run_batch()  # nothing published: the bad row goes to the dead-letter table alone

    assert rig.publisher.published == [] and "prepare" not in rig.journal
    assert bad in rig.store.dead_letter and sorted(rig.store.rows) == [later, other]
    assert rig.dead_lettered("invalid") == 1

    rig.relay.run_batch()
    assert [m.row_id for m in rig.publisher.published] == [other]
    assert list(rig.store.rows) == [later]


def test_a_row_whose_exchange_is_missing_holds_back_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, missing={"gone"})
    first = rig.store.add(ordering_key="a", exchange="gone")
    later = rig.store.add(ordering_key="a")

    rig.relay.run_batch()

    assert rig.publisher.published == []
    assert rig.store.rows[first].attempts == 1 and rig.store.rows[later].attempts == 0
    assert rig.row_failures("exchange_not_found") == 1
