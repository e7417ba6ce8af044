"""The test double of the services' unit tests (outbox_relay.testing.RecordingOutbox): the
enqueue functions check and encode events for it as for a database, it records them in order,
and it behaves like a connection's transaction."""

from __future__ import annotations

import asyncio
import re
import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import psycopg
import psycopg.errors
import pytest

from outbox_relay import (
    Event,
    Inbox,
    InboxMessage,
    InvalidEvent,
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
)
from outbox_relay.testing import RecordedEvent, RecordingOutbox
from tests.conftest import ROOT

AT = datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def paid(outbox: RecordingOutbox, order_id: int = 42, **changes: Any) -> str:
    """A service's code under test: one event in the caller's transaction."""
    values: dict[str, Any] = dict(exchange="orders", routing_key="order.paid",
                                  payload={"order_id": order_id, "amount": Decimal("19.90")},
                                  ordering_key=f"order-{order_id}")
    values.update(changes)
    return enqueue(outbox, **values)


def test_events_are_recorded_in_order_as_the_relay_will_send_them() -> None:
    outbox = RecordingOutbox()
    first = paid(outbox, headers={"tenant": uuid.UUID(int=1)}, available_at=AT)
    ids = enqueue_many(outbox, [Event("orders", "order.shipped", {"n": n}) for n in range(3)])
    raw = enqueue(outbox, exchange="", routing_key="blobs", payload=b"\x00\x01",
                  content_type="application/x-blob", table="app.events")
    outbox.commit()

    assert [e.message_id for e in outbox.events] == [first, *ids, raw]
    assert outbox.events[0] == RecordedEvent(
        message_id=first, exchange="orders", routing_key="order.paid",
        payload={"order_id": 42, "amount": "19.90"},
        body=b'{"order_id": 42, "amount": "19.90"}', content_type="application/json",
        headers={"tenant": "00000000-0000-0000-0000-000000000001"}, ordering_key="order-42",
        available_at=AT, table="outbox")
    assert [e.payload for e in outbox.events[1:4]] == [{"n": 0}, {"n": 1}, {"n": 2}]
    blob = outbox.events[4]
    assert (blob.payload, blob.body, blob.content_type, blob.table, blob.available_at) == (
        b"\x00\x01", b"\x00\x01", "application/x-blob", "app.events", None)


def test_what_the_relay_would_refuse_is_refused_and_nothing_is_recorded() -> None:
    outbox = RecordingOutbox()
    with pytest.raises(InvalidEvent) as caught:
        paid(outbox, routing_key="r" * 256)
    assert caught.value.field == "routing_key"
    with pytest.raises(InvalidEvent) as caught:
        enqueue_many(outbox, [Event("", "q", 1), Event("", "q", {1, 2})])
    assert (caught.value.index, caught.value.field) == (1, "payload")
    paid(outbox)  # the transaction is still usable
    outbox.commit()
    assert len(outbox.events) == 1


def test_json_default_applies_as_for_a_database() -> None:
    outbox = RecordingOutbox()
    paid(outbox, payload={"tags": {"a"}}, json_default=sorted)
    outbox.commit()
    assert outbox.assert_enqueued().payload == {"tags": ["a"]}


# -- a transaction -----------------------------------------------------------------------------


def test_written_events_are_pending_until_commit_and_gone_on_rollback() -> None:
    outbox = RecordingOutbox()
    kept = paid(outbox, 1)
    assert [e.message_id for e in outbox.pending] == [kept] and outbox.events == []
    outbox.commit()
    paid(outbox, 2)
    outbox.rollback()

    assert [e.message_id for e in outbox.events] == [kept] and outbox.pending == []


def test_a_transaction_block_commits_at_its_end_and_rolls_back_if_it_raises() -> None:
    outbox = RecordingOutbox()
    with outbox.transaction():
        paid(outbox, 1)
        assert outbox.events == []
    with pytest.raises(RuntimeError), outbox.transaction():
        paid(outbox, 2)
        raise RuntimeError("payment refused")
    with outbox.transaction():
        paid(outbox, 3)
        raise psycopg.Rollback()  # leaves the block quietly, as in psycopg

    assert [e.payload["order_id"] for e in outbox.events] == [1]


def test_a_block_inside_a_transaction_is_a_savepoint() -> None:
    outbox = RecordingOutbox()
    with outbox.transaction():
        paid(outbox, 1)
        with pytest.raises(RuntimeError), outbox.transaction():
            paid(outbox, 2)
            raise RuntimeError
        with outbox.transaction():
            paid(outbox, 3)
    paid(outbox, 4)  # implicitly begins a transaction, as a psycopg connection does
    with outbox.transaction():  # a savepoint of it: its end commits nothing
        paid(outbox, 5)

    assert [e.payload["order_id"] for e in outbox.events] == [1, 3]
    assert [e.payload["order_id"] for e in outbox.pending] == [4, 5]


def test_commit_inside_a_block_is_refused_as_psycopg_refuses_it() -> None:
    outbox = RecordingOutbox()
    with outbox.transaction():
        with pytest.raises(psycopg.ProgrammingError, match="commit"):
            outbox.commit()
        with pytest.raises(psycopg.ProgrammingError, match="rollback"):
            outbox.rollback()


def test_a_message_id_written_twice_fails_the_transaction_as_a_unique_index_does() -> None:
    outbox = RecordingOutbox()
    paid(outbox, 1, message_id="m-1")
    outbox.commit()
    paid(outbox, 2, message_id="m-2")
    with pytest.raises(psycopg.errors.UniqueViolation, match=r"outbox_message_id_key.*\(m-1\)"):
        paid(outbox, 3, message_id="m-1")
    with pytest.raises(psycopg.errors.InFailedSqlTransaction):
        paid(outbox, 4)
    outbox.commit()  # PostgreSQL commits nothing of an aborted transaction
    paid(outbox, 5, message_id="m-1", table="other")  # another table, another index
    outbox.commit()

    with outbox.transaction():
        with pytest.raises(psycopg.errors.UniqueViolation), outbox.transaction():
            paid(outbox, 6, message_id="m-1")
        paid(outbox, 7)  # the savepoint's rollback took the failure with it
    assert [e.payload["order_id"] for e in outbox.events] == [1, 5, 7]


# -- asyncio -----------------------------------------------------------------------------------


def test_the_async_names_record_when_awaited() -> None:
    outbox = RecordingOutbox()

    async def service() -> None:
        async with outbox.transaction():
            pending = enqueue_async(outbox, exchange="orders", routing_key="a", payload=1)
            assert outbox.pending == []  # nothing is written before the await
            await pending
            await enqueue_many_async(outbox, [Event("orders", "b", 2), Event("orders", "c", 3)])
        await enqueue_async(outbox, exchange="orders", routing_key="d", payload=4)
        await outbox.rollback()
        await enqueue_async(outbox, exchange="orders", routing_key="e", payload=5)
        await outbox.commit()

    asyncio.run(service())
    assert [e.routing_key for e in outbox.events] == ["a", "b", "c", "e"]


def test_a_forgotten_await_fails_the_test_that_reads_the_outbox() -> None:
    outbox = RecordingOutbox()

    async def service() -> None:
        async with outbox.transaction():
            enqueue_async(outbox, exchange="orders", routing_key="a", payload=1,
                          message_id="lost")

    with pytest.warns(RuntimeWarning):
        asyncio.run(service())
    for read in (lambda: outbox.events, lambda: outbox.pending, outbox.assert_enqueued,
                 outbox.assert_nothing_enqueued, lambda: outbox.find(routing_key="a")):
        with pytest.raises(AssertionError, match=r"enqueue_async\(\) called at .* was never "
                                                 r"awaited: 1 event\(s\) NOT written .*lost"):
            read()


# -- what a test reads -------------------------------------------------------------------------


def test_assertions_say_what_was_recorded() -> None:
    outbox = RecordingOutbox()
    outbox.assert_nothing_enqueued()
    paid(outbox, 1, message_id="m-1")
    paid(outbox, 2, message_id="m-2", routing_key="order.refunded")
    outbox.commit()
    paid(outbox, 3, message_id="m-3")

    assert outbox.assert_enqueued(routing_key="order.refunded").message_id == "m-2"
    assert outbox.find(routing_key="order.paid", ordering_key="order-1")[0].message_id == "m-1"
    with pytest.raises(AssertionError) as caught:
        outbox.assert_enqueued(routing_key="order.paid", payload={"order_id": 3,
                                                                  "amount": "19.90"})
    assert str(caught.value) == "\n".join([
        "0 committed events match routing_key='order.paid', payload={'order_id': 3, "
        "'amount': '19.90'}, expected 1",
        "committed:",
        "  exchange='orders' routing_key='order.paid' message_id='m-1' payload={'order_id': 1, "
        "'amount': '19.90'} ordering_key='order-1'",
        "  exchange='orders' routing_key='order.refunded' message_id='m-2' payload={'order_id': "
        "2, 'amount': '19.90'} ordering_key='order-2'",
        "pending, not committed:",
        "  exchange='orders' routing_key='order.paid' message_id='m-3' payload={'order_id': 3, "
        "'amount': '19.90'} ordering_key='order-3'"])
    with pytest.raises(AssertionError, match="2 committed events match anything"):
        outbox.assert_enqueued()
    with pytest.raises(AssertionError, match="events were enqueued"):
        outbox.assert_nothing_enqueued()
    with pytest.raises(TypeError, match="RecordedEvent has no field key"):
        outbox.find(key="order-1")
    outbox.clear()
    outbox.assert_nothing_enqueued()


def test_it_runs_no_other_sql() -> None:
    message = InboxMessage(message_id="m", body=b"{}")
    with pytest.raises(TypeError, match="RecordingOutbox records what enqueue"):
        Inbox().record(RecordingOutbox(), message)


def test_available_at_is_kept_as_given() -> None:
    outbox = RecordingOutbox()
    later = datetime.now(timezone.utc) + timedelta(minutes=5)
    paid(outbox, available_at=later)
    outbox.commit()
    assert outbox.assert_enqueued().available_at == later


def test_the_documented_example_passes() -> None:
    page = (ROOT / "docs" / "python-api.md").read_text()
    section = page.split("### Testing a service without a database", 1)[1]
    example = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert example is not None
    namespace: dict[str, Any] = {}
    exec(compile(example.group(1), "docs/python-api.md", "exec"), namespace)
    namespace["test_paying_an_order_announces_it"]()
