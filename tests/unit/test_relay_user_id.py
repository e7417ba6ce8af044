"""The relay sets its connection's user as every message's user_id (RabbitMQ refuses any other,
so a consumer can tell a relay's message from another publisher's): on the loop's fakes."""

from __future__ import annotations

from typing import Any

from outbox_relay.relay.metrics import RelayMetrics
from outbox_relay.relay.settings import RelaySettings
from outbox_relay.relay.worker import Relay
from tests.unit.fakes import FakePublisher, FakeStore, StopWhen


def relay(**overrides: Any) -> tuple[Relay, FakeStore, FakePublisher]:
    values: dict[str, Any] = dict(
        database_url="postgresql://relay:secret@db/app", amqp_url="amqp://relay:secret@mq/",
        batch_size=2, retry_base_delay=0.0, retry_max_delay=0.0, max_message_bytes=1000)
    values.update(overrides)
    store, publisher = FakeStore([]), FakePublisher([])
    built = Relay(RelaySettings(**values), store, publisher, metrics=RelayMetrics(),
                  shutdown=StopWhen(), instance=0xABC)
    built.ensure_connected()
    return built, store, publisher


def user_ids(publisher: FakePublisher) -> dict[int, str | None]:
    return {m.row_id: m.properties.user_id for m in publisher.published}


def test_every_message_carries_the_connections_user_the_batch_claimed_ahead_too() -> None:
    loop, store, publisher = relay()
    ids = [store.add(), store.add(ordering_key="k1"), store.add(headers={"tenant": "a"}),
           store.add(ordering_key="k2")]

    loop.run_batch()  # the first two, and the next two claimed (and built) ahead
    loop.run_batch()

    assert user_ids(publisher) == dict.fromkeys(ids, "relay-user")


def test_a_batch_built_ahead_is_built_again_for_another_user() -> None:
    loop, store, publisher = relay()
    first = store.add_many(2)
    ahead = store.add_many(2)
    loop.run_batch()
    assert [r.id for r in loop.claimed_ahead] == ahead

    publisher.user_id = "other-user"  # a reconnect to a node of a cluster under another user
    loop.run_batch()

    assert user_ids(publisher) == {**dict.fromkeys(first, "relay-user"),
                                   **dict.fromkeys(ahead, "other-user")}


def test_no_user_id_when_the_connection_has_no_user_name() -> None:
    loop, store, publisher = relay()
    publisher.user_id = None  # credentials without a name (EXTERNAL) and no OUTBOX_AMQP_USER_ID
    row = store.add(ordering_key="k")

    loop.run_batch()

    assert user_ids(publisher) == {row: None}
