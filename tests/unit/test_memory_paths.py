"""The relay loop's share of its memory bound (docs/reliability.md#memory), against the fakes:
a batch claimed ahead takes no row beyond what is left of the byte budget, and a big row that
can never be published is moved by PostgreSQL, not sent back to it from the relay."""

from __future__ import annotations

from typing import Any

from outbox_relay.relay.metrics import RelayMetrics
from outbox_relay.relay.settings import RelaySettings
from outbox_relay.relay.worker import DEAD_LETTER_COPY_MAX, Relay
from tests.unit.fakes import FakePublisher, FakeStore, StopWhen


def relay(**overrides: Any) -> tuple[Relay, FakeStore, FakePublisher]:
    values: dict[str, Any] = dict(
        database_url="postgresql://relay:secret@db/app", amqp_url="amqp://relay:secret@mq/",
        batch_size=10, max_attempts=3, retry_base_delay=0.0, retry_max_delay=0.0,
        poll_min_interval=0.01, poll_max_interval=0.08, max_message_bytes=1 << 22)
    values.update(overrides)
    journal: list[str] = []
    store, publisher = FakeStore(journal), FakePublisher(journal)
    loop = Relay(RelaySettings(**values), store, publisher, metrics=RelayMetrics(),
                 shutdown=StopWhen(), instance=0xABC)
    loop.ensure_connected()
    journal.clear()
    return loop, store, publisher


def size(store: FakeStore, row_id: int) -> int:
    return store.rows[row_id].claimed().row_bytes


def test_the_batch_claimed_ahead_takes_no_row_beyond_what_is_left_of_the_budget() -> None:
    loop, store, publisher = relay(batch_max_bytes=10_000)
    first = store.add_many(2, payload_bytes=b"a" * 3000)
    big = store.add(payload_bytes=b"b" * 6000)  # more than the 10,000 - 6,000 left
    budget_left = 10_000 - sum(size(store, i) for i in first)

    loop.run_batch()

    _claim, ahead = store.called("claim")
    assert (ahead["max_bytes"], ahead["one_row_at_least"]) == (budget_left, False)
    assert loop.claimed_ahead == [] and big in store.rows  # not even one row: left for later
    loop.run_batch()
    assert [m.row_id for m in publisher.batches[-1]] == [big]  # the next batch takes it alone


def test_a_batch_of_its_own_takes_one_row_whatever_its_size() -> None:
    loop, store, publisher = relay(batch_max_bytes=1000)
    big = store.add(payload_bytes=b"b" * 6000)

    loop.run_batch()

    assert store.called("claim")[0]["one_row_at_least"] is True
    assert publisher.published_ids() == [big]


def test_a_retried_row_beyond_the_budget_left_is_not_claimed_ahead() -> None:
    loop, store, _publisher = relay(batch_max_bytes=10_000)
    first = store.add_many(2, payload_bytes=b"a" * 3000)
    # Due once the first batch is claimed (a retried row is claimed alone, before fresh ones).
    retried = store.add(payload_bytes=b"r" * 6000, attempts=1, available_at=1.0)
    store.before("claim", lambda: None)
    store.before("claim", lambda: setattr(store, "now", 2.0))

    loop.run_batch()

    assert [c["one_row_at_least"] for c in store.called("claim")] == [True, False]
    assert retried in store.rows and loop.claimed_ahead == []
    assert all(i not in store.rows for i in first)


def test_a_big_row_that_can_never_be_published_is_moved_by_postgresql() -> None:
    loop, store, publisher = relay(batch_max_bytes=1 << 24)
    before = store.add()
    bad = store.add(payload_bytes=b"x" * DEAD_LETTER_COPY_MAX, routing_key="k" * 256)
    after = store.add()

    loop.run_batch()  # rolled back: nothing published, the bad row moved by id

    assert store.called("dead_letter_claimed") == []
    assert list(store.called("dead_letter_rows")[0]["reasons"]) == [bad]
    assert bad in store.dead_letter and publisher.batches == []
    loop.run_batch()
    assert publisher.published_ids() == [before, after]


def test_a_small_row_that_can_never_be_published_goes_with_its_batch() -> None:
    loop, store, publisher = relay()
    before = store.add()
    bad = store.add(routing_key="k" * 256)

    loop.run_batch()

    assert [row_id for row_id, _ in store.called("dead_letter_claimed")[0]["rows"]] == [bad]
    assert publisher.published_ids() == [before]
