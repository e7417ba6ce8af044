"""The properties encoded by outbox_relay.properties are byte for byte what pika writes, and every
shape the fast path does not cover is left to pika (and fails there as it always did)."""

from __future__ import annotations

import random
from typing import Any

import pika
import pika.frame
import pytest
from pika.spec import BasicProperties

from outbox_relay import properties as wire_properties
from outbox_relay.relay.messages import EncodedProperties, encoded


def pika_wire(properties: BasicProperties, body_size: int = 250) -> bytes:
    plain = BasicProperties(**{name: getattr(properties, name) for name in (
        "content_type", "headers", "delivery_mode", "message_id", "timestamp", "user_id")})
    return pika.frame.Header(1, body_size, plain).marshal()  # type: ignore[no-any-return]


SHAPES: list[dict[str, Any] | None] = [
    None, {}, {"x-ordering-key": "order-42", "x-outbox-id": 123456},
    {"x-outbox-id": 7, "x-ordering-key": "k"},  # a producer's own names first: their order kept
    {"x-ordering-key": "", "x-outbox-id": 0},
    {"x-ordering-key": "ключ-€-😀", "x-outbox-id": -1},
    {"x-outbox-id": (1 << 31) - 1}, {"x-outbox-id": 1 << 31}, {"x-outbox-id": -(1 << 31)},
    {"x-outbox-id": -(1 << 31) - 1}, {"x-outbox-id": (1 << 63) - 1}, {"x-outbox-id": -(1 << 63)},
    {"n" * 255: "v"}, {"tenant": "a", "trace": "b" * 70000, "x-outbox-id": 3},
]


# The user of the relay's connection (its user_id property): none, the usual, the longest, odd.
USERS = [None, "outbox-relay", "u" * 255, "", "ключ-€-😀", "guest"]


@pytest.mark.parametrize("user_id", USERS, ids=range(len(USERS)))
@pytest.mark.parametrize("headers", SHAPES, ids=range(len(SHAPES)))
def test_the_fast_shapes_encode_as_pika_does(headers: dict[str, Any] | None,
                                             user_id: str | None) -> None:
    properties = encoded(message_id="m-1", content_type="application/json", headers=headers,
                         timestamp=1_764_000_000, user_id=user_id)
    assert isinstance(properties, EncodedProperties)
    assert pika.frame.Header(1, 250, properties).marshal() == pika_wire(properties)
    assert properties.headers == (headers or None) and properties.delivery_mode == 2
    assert properties.user_id == user_id


@pytest.mark.parametrize("user_id", [None, "outbox-relay"])
def test_encoded_properties_hold_what_pikas_own_would(user_id: str | None) -> None:
    # EncodedProperties sets pika's attributes itself (BasicProperties.__init__ only assigns):
    # the same names and values, plus the wire form. The header table is kept in the wire form
    # only (a batch holds no decoded tables) and read back from it.
    fields = {"message_id": "m-1", "content_type": "application/json", "timestamp": 5,
              "headers": {"k": "v"}, "user_id": user_id}
    properties = encoded(**fields)  # type: ignore[arg-type]
    assert isinstance(properties, EncodedProperties)
    attributes = dict(vars(properties))
    assert attributes.pop("wire") == properties.wire
    assert "headers" not in attributes
    attributes["headers"] = properties.headers
    assert attributes == vars(BasicProperties(delivery_mode=2, **fields))


def test_random_flat_tables_encode_as_pika_does() -> None:
    rng = random.Random(7)
    alphabet = "ab-_.é€😀 \x00"
    for _ in range(2000):
        headers = {
            "".join(rng.choices(alphabet, k=rng.randint(1, 12))):
                rng.choice([rng.randint(-(1 << 63), (1 << 63) - 1), rng.randint(-99, 99),
                            "".join(rng.choices(alphabet, k=rng.randint(0, 40)))])
            for _ in range(rng.randint(0, 5))}
        properties = encoded(message_id="".join(rng.choices(alphabet, k=rng.randint(0, 60))),
                             content_type=rng.choice(["application/json", "text/plain", ""]),
                             headers=headers, timestamp=rng.randint(0, 253402300799),
                             user_id=rng.choice([None, "".join(rng.choices(alphabet, k=12))]))
        assert isinstance(properties, EncodedProperties)
        assert pika.frame.Header(1, 9, properties).marshal() == pika_wire(properties, 9)


@pytest.mark.parametrize("headers", [
    {"flag": True}, {"n": 1.5}, {"nested": {"a": 1}}, {"list": [1]}, {"none": None},
    {"big": 1 << 63}, {"n" * 256: "v"}, {"surrogate": "\ud800"},
], ids=lambda h: next(iter(h))[:8])
def test_other_shapes_are_left_to_pika(headers: dict[str, Any]) -> None:
    properties = encoded(message_id="m-1", content_type="application/json", headers=headers,
                         timestamp=1)
    assert type(properties) is BasicProperties
    assert properties.headers == headers


@pytest.mark.parametrize("fields", [
    {"message_id": "m" * 256}, {"content_type": "c" * 256}, {"timestamp": -1},
    {"timestamp": 1 << 64}, {"message_id": "\udc80"}, {"user_id": "u" * 256},
    {"user_id": "€" * 86}, {"user_id": "\udc80"},
])
def test_fields_pika_would_refuse_are_left_to_pika(fields: dict[str, Any]) -> None:
    values = {"message_id": "m-1", "content_type": "application/json", "timestamp": 1, **fields}
    properties = encoded(headers=None, **values)
    assert type(properties) is BasicProperties
    with pytest.raises(Exception):  # noqa: B017  # pika's own error, whatever its type
        pika.frame.Header(1, 9, properties).marshal()


def test_the_wire_form_measures_the_header_frame() -> None:
    """outbox_relay.rules sizes a header frame from it, against the broker's frame_max."""
    from outbox_relay.rules import HEADER_FRAME_OVERHEAD
    properties = encoded(message_id="m", content_type="t", headers={"k": "v" * 1000}, timestamp=5)
    assert isinstance(properties, EncodedProperties)
    frame = pika.frame.Header(1, 123, properties).marshal()
    assert len(frame) == HEADER_FRAME_OVERHEAD + len(properties.wire)


def test_the_flags_are_the_specs() -> None:
    """outbox_relay.properties imports no pika: its flag bits are written out, and are pika's."""
    for name in ("CONTENT_TYPE", "HEADERS", "DELIVERY_MODE", "MESSAGE_ID", "TIMESTAMP", "USER_ID"):
        assert getattr(wire_properties, f"FLAG_{name}") == getattr(BasicProperties, f"FLAG_{name}")
