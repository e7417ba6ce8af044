"""AmqpPublisher's handling of a connection that is already gone (no broker needed)."""

from __future__ import annotations

from typing import Any

import pytest

from outbox_relay.relay import publisher as publisher_module
from outbox_relay.relay.publisher import AmqpPublisher


class ClosedConnection:
    """What pika leaves behind when the broker closed the connection: its I/O loop is closed."""

    is_open = False

    def sleep(self, _seconds: float) -> None:
        raise ValueError("Timeout closed before call")  # what pika raises then


def make() -> AmqpPublisher:
    return AmqpPublisher("amqp://guest:guest@127.0.0.1:9/", ledger_stream="ledger",
                         ledger_max_age="7D", confirm_timeout=1, connect_timeout=1)


def test_idle_on_a_connection_the_broker_closed_waits_and_drops_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(publisher_module.time, "sleep", slept.append)
    pub = make()
    pub._conn = ClosedConnection()
    pub.idle(0.25)
    assert slept == [0.25]
    assert pub._conn is None and not pub.connected


def test_publishing_without_a_connection_blames_no_row() -> None:
    pub = make()
    message: Any = publisher_module.Message(1, "m-1", "", "q", b"{}", None)
    result = pub.publish_batch([message])
    assert result.transient and not result.failed and not result.suspect


class RecordingChannel:
    """The asynchronous channel's basic_publish; pika refuses to encode the poisoned message."""

    is_open = True

    def __init__(self) -> None:
        self.published: list[str] = []

    def basic_publish(self, *, exchange: str, routing_key: str, body: bytes, properties: Any,
                      mandatory: bool) -> None:
        if body == b"poison":
            import struct

            raise struct.error("argument out of range")  # what pika's encoder raises
        self.published.append(routing_key)


class QuietConnection:
    is_open = True

    def __init__(self) -> None:
        self._impl = type("Impl", (), {"_transport": None, "_adapter_emit_data": print})()


def test_a_message_pika_cannot_encode_fails_alone_and_uses_no_delivery_tag() -> None:
    pub = make()
    pub._conn, pub._channel = QuietConnection(), RecordingChannel()
    messages: list[Any] = [publisher_module.Message(n, f"m-{n}", "x", f"k{n}",
                                                    b"poison" if n == 2 else b"ok", None)
                           for n in (1, 2, 3)]
    pub._result = publisher_module.PublishResult()
    pub._publish_all(messages)
    assert list(pub._pending.items()) == [(1, 1), (2, 3)]  # tags stay aligned with the broker's
    assert set(pub._result.failed) == {2}
    assert pub._result.failed[2].detail.startswith("cannot be encoded: error(")


def test_after_a_message_pika_cannot_encode_the_rest_of_its_key_is_held_back() -> None:
    pub = make()
    pub._conn, pub._channel = QuietConnection(), RecordingChannel()
    messages: list[Any] = [
        publisher_module.Message(n, f"m-{n}", "x", f"k{n}", b"poison" if n == 2 else b"ok",
                                 None, key)
        for n, key in ((1, "a"), (2, "a"), (3, "b"), (4, "a"), (5, None))]
    pub._result = publisher_module.PublishResult()
    pub._stopped_keys = set()
    pub._publish_all(messages)
    assert pub._channel.published == ["k1", "k3", "k5"]
    assert set(pub._result.failed) == {2} and pub._result.held == {4}


class Frame:
    def __init__(self, method: Any) -> None:
        self.method = method


def test_a_nack_makes_its_row_a_suspect_and_the_rest_of_the_batch_goes_on() -> None:
    """A nack names the message a queue refused (a full reject-publish queue): that row is a
    suspect, the batch's other messages are confirmed as usual, nothing is transient."""
    import pika.spec

    pub = make()
    pub._result = publisher_module.PublishResult()
    pub._pending = {1: 11, 2: 12, 3: 13, 4: 14}
    pub._on_confirm(Frame(pika.spec.Basic.Ack(delivery_tag=1)))
    pub._on_confirm(Frame(pika.spec.Basic.Nack(delivery_tag=2)))
    pub._on_confirm(Frame(pika.spec.Basic.Ack(delivery_tag=4, multiple=True)))
    pub._settle_unconfirmed()
    assert pub._result.confirmed == {11, 13, 14}
    assert list(pub._result.suspect) == [12]
    assert pub._result.suspect[12].reason is publisher_module.Reason.NACKED
    assert pub._result.transient is None and not pub._result.failed
    assert pub._nacked == 1


def test_after_a_nack_a_channel_that_cannot_be_replaced_drops_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pub = make()
    closed: list[bool] = []

    def no_channel() -> None:
        raise publisher_module.TransientError("RabbitMQ did not enable publisher confirms in time")

    monkeypatch.setattr(pub, "_open_channel", no_channel)
    monkeypatch.setattr(pub, "close", lambda handshake=True: closed.append(handshake))
    pub._replace_channel()
    assert closed == [False]  # the loop reconnects, with its own backoff
