"""The AMQP type and correlation_id of an event (issue 34): what the producer API takes and
refuses, what the relay publishes and dead-letters (one rule for both), how the properties are
encoded, and what the inbox and the test double read back."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace
from typing import Any

import pika.frame
import pytest
from pika.spec import BasicProperties

from outbox_relay import Event, InboxMessage, InvalidEvent, enqueue, enqueue_many
from outbox_relay import properties as wire_properties
from outbox_relay.model import Message, Unpublishable
from outbox_relay.producer import enqueue_async
from outbox_relay.relay.messages import EncodedProperties, encoded, to_message
from outbox_relay.testing import RecordingOutbox
from tests.unit.test_messages import row
from tests.unit.test_producer import FakeCursor, good, refused

FIELDS = ("message_type", "correlation_id")
CORRELATION = uuid.UUID("0b9c5e4e-8f1d-4d2a-9a55-7d1f2c3b4a5e")
# Junk a hostile producer can write into either column, and the relay's reason for it.
HOSTILE = [
    ("x" * 256, "{field} is longer than 255 bytes"),
    ("é" * 128, "{field} is longer than 255 bytes"),  # 256 bytes, 128 characters
    ("order.paid\r\nX-Injected: 1", "{field} holds the control character U+000D at position 10"),
    ("\x1b[31mred", "{field} holds the control character U+001B at position 0"),
    ("tab\there", "{field} holds the control character U+0009 at position 3"),
    ("del\x7f", "{field} holds the control character U+007F at position 3"),
    ("c1\x85", "{field} holds the control character U+0085 at position 2"),
]


def sent(**changes: Any) -> Message:
    built = to_message(row(**changes), max_bytes=1000, user_id="outbox-relay")
    assert isinstance(built, Message), built
    return built


def wire_of(properties: Any) -> bytes:
    return pika.frame.Header(1, 9, properties).marshal()  # type: ignore[no-any-return]


# -- the relay --------------------------------------------------------------------------------


def test_the_relay_sets_both_properties_from_the_row() -> None:
    props = sent(message_type="order.paid.v1", correlation_id=str(CORRELATION)).properties
    assert (props.type, props.correlation_id) == ("order.paid.v1", str(CORRELATION))
    # On the wire as pika itself writes them, the row's headers and the relay's user with them.
    plain = BasicProperties(**{name: getattr(props, name) for name in (
        "content_type", "headers", "delivery_mode", "correlation_id", "message_id", "timestamp",
        "type", "user_id")})
    assert isinstance(props, EncodedProperties)
    assert wire_of(props) == wire_of(plain)
    decoded = BasicProperties()
    decoded.decode(props.wire)
    assert (decoded.type, decoded.correlation_id, decoded.message_id) == (
        "order.paid.v1", str(CORRELATION), "evt-7")


def test_a_row_that_sets_neither_publishes_neither() -> None:
    props = sent().properties
    assert (props.type, props.correlation_id) == (None, None)
    decoded = BasicProperties()
    decoded.decode(props.wire)
    assert (decoded.type, decoded.correlation_id) == (None, None)


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize(("value", "reason"), HOSTILE, ids=range(len(HOSTILE)))
def test_junk_in_either_column_is_dead_lettered_with_a_reason(field: str, value: str,
                                                              reason: str) -> None:
    built = to_message(row(**{field: value}), max_bytes=1000)
    assert isinstance(built, Unpublishable)
    assert built.reason == reason.format(field=field)


@pytest.mark.parametrize("field", FIELDS)
def test_the_limits_are_exact(field: str) -> None:
    for value in ("x" * 255, "é" * 127 + "x", "", "ключ-€-😀 with spaces", "~!@#$%^&*()"):
        assert getattr(sent(**{field: value}).properties,
                       "type" if field == "message_type" else field) == value


# -- the encoder ------------------------------------------------------------------------------


VALUES = [None, "", "t", "order.paid.v1", "x" * 255, "ключ-€-😀"]


@pytest.mark.parametrize("message_type", VALUES, ids=range(len(VALUES)))
@pytest.mark.parametrize("correlation_id", VALUES, ids=range(len(VALUES)))
@pytest.mark.parametrize("headers", [None, {"x-ordering-key": "k", "x-outbox-id": 3}])
@pytest.mark.parametrize("user_id", [None, "outbox-relay"])
def test_the_struct_encoder_writes_what_pika_writes(message_type: str | None,
                                                    correlation_id: str | None,
                                                    headers: dict[str, Any] | None,
                                                    user_id: str | None) -> None:
    props = encoded(message_id="m-1", content_type="application/json", headers=headers,
                    timestamp=1_764_000_000, user_id=user_id, message_type=message_type,
                    correlation_id=correlation_id)
    assert isinstance(props, EncodedProperties)
    plain = BasicProperties(content_type="application/json", headers=headers, delivery_mode=2,
                            message_id="m-1", timestamp=1_764_000_000, user_id=user_id,
                            type=message_type, correlation_id=correlation_id)
    assert wire_of(props) == wire_of(plain)


@pytest.mark.parametrize("field", ["type", "correlation_id"])
@pytest.mark.parametrize("value", ["x" * 256, "\udc80"])
def test_values_pika_would_refuse_are_left_to_pika(field: str, value: str) -> None:
    fields = {"delivery_mode": 2, "message_id": "m", "content_type": "c", "headers": None,
              "timestamp": 1, field: value}
    assert wire_properties.wire(**fields) is None


def test_the_flags_are_the_specs() -> None:
    for name in ("CORRELATION_ID", "TYPE"):
        assert getattr(wire_properties, f"FLAG_{name}") == getattr(BasicProperties,
                                                                   f"FLAG_{name}")


# -- the producer API -------------------------------------------------------------------------


def test_enqueue_writes_both_and_a_uuid_correlation_id_as_its_string() -> None:
    cursor = FakeCursor()
    enqueue(cursor, **good(message_type="order.paid.v1", correlation_id=CORRELATION))
    [(_, params)] = cursor.calls
    assert (params["message_type"], params["correlation_id"]) == (["order.paid.v1"],
                                                                  [str(CORRELATION)])
    cursor = FakeCursor()
    enqueue(cursor, **good())
    [(_, params)] = cursor.calls
    assert (params["message_type"], params["correlation_id"]) == ([None], [None])


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize(("value", "reason"), HOSTILE, ids=range(len(HOSTILE)))
def test_enqueue_refuses_what_the_relay_would_dead_letter(field: str, value: str,
                                                          reason: str) -> None:
    caught = refused(**{field: value})
    assert (caught.field, caught.reason) == (field, reason.format(field=field))
    assert str(caught).count("\n") == 0


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize(("value", "words"), [
    (5, "must be a str or None, got int"), (b"t", "must be a str or None, got bytes"),
    ("a\x00b", "contains a NUL character"), ("\udc80", "is not valid UTF-8 text"),
])
def test_enqueue_refuses_values_of_the_wrong_kind(field: str, value: Any, words: str) -> None:
    caught = refused(**{field: value})
    assert caught.field == field and words in caught.reason


def test_a_bad_event_of_a_batch_is_named_by_its_index() -> None:
    cursor = FakeCursor()
    with pytest.raises(InvalidEvent) as caught:
        enqueue_many(cursor, [Event("orders", "a", {}, message_type="ok"),
                              Event("orders", "b", {}, correlation_id="bad\n")])
    assert (caught.value.index, caught.value.field) == (1, "correlation_id")
    assert cursor.calls == []


def test_the_test_double_records_both() -> None:
    outbox = RecordingOutbox()
    enqueue(outbox, **good(message_type="order.paid.v1", correlation_id=CORRELATION))
    asyncio.run(enqueue_async(outbox, **good(correlation_id="req-1")))
    outbox.commit()
    first, second = outbox.events
    assert (first.message_type, first.correlation_id) == ("order.paid.v1", str(CORRELATION))
    assert (second.message_type, second.correlation_id) == (None, "req-1")
    outbox.assert_enqueued(message_type="order.paid.v1", correlation_id=str(CORRELATION))


# -- the inbox --------------------------------------------------------------------------------


def test_the_inbox_message_reads_both_from_pika_and_aio_pika() -> None:
    props = BasicProperties(message_id="m", type="order.paid.v1", correlation_id="req-1")
    method = SimpleNamespace(routing_key="r", exchange="e", redelivered=False)
    message = InboxMessage.from_pika(method, props, b"{}")
    assert (message.message_type, message.correlation_id) == ("order.paid.v1", "req-1")
    incoming = SimpleNamespace(message_id="m", body=b"{}", headers={}, routing_key="r",
                               exchange="e", content_type=None, redelivered=False,
                               user_id=None, timestamp=None, type="order.paid.v1",
                               correlation_id="req-1")
    message = InboxMessage.from_aio_pika(incoming)  # type: ignore[arg-type]
    assert (message.message_type, message.correlation_id) == ("order.paid.v1", "req-1")
    bare = InboxMessage.from_pika(method, BasicProperties(message_id="m"), b"{}")
    assert (bare.message_type, bare.correlation_id) == (None, None)
