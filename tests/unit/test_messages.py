"""Claimed rows to AMQP messages: bodies, content types, properties, and rows never publishable."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import pytest

from relay.messages import SHORTSTR_MAX, to_message
from relay.publisher import Message
from relay.store import OutboxRow

CREATED = datetime(2024, 5, 6, 7, 8, 9, tzinfo=timezone.utc)


def row(**changes: Any) -> OutboxRow:
    base = OutboxRow(id=7, message_id="evt-7", exchange="events", routing_key="order.created",
                     ordering_key="order-1", payload='{"total": 12}', payload_bytes=None,
                     headers={}, content_type=None, created_at=CREATED, attempts=0,
                     last_error=None)
    return replace(base, **changes)


def message(**changes: Any) -> Message:
    built = to_message(row(**changes), max_bytes=1000)
    assert isinstance(built, Message), built
    return built


def error(max_bytes: int = 1000, **changes: Any) -> str:
    built = to_message(row(**changes), max_bytes=max_bytes)
    assert isinstance(built, str), built
    return built


# -- bodies and content types -----------------------------------------------------------------


def test_json_payload_is_sent_as_its_text_with_json_content_type() -> None:
    built = message()

    assert built.body == b'{"total": 12}'
    assert built.properties.content_type == "application/json"


def test_json_text_is_utf8_encoded() -> None:
    assert message(payload='{"name": "Zoë"}').body == '{"name": "Zoë"}'.encode()


def test_raw_bytes_are_sent_as_they_are_with_octet_stream() -> None:
    built = message(payload=None, payload_bytes=b"\x00\xffraw")

    assert built.body == b"\x00\xffraw"
    assert built.properties.content_type == "application/octet-stream"


def test_memoryview_bytes_become_bytes() -> None:
    built = message(payload=None, payload_bytes=memoryview(b"abc"))

    assert built.body == b"abc"
    assert type(built.body) is bytes


def test_row_content_type_overrides_the_default() -> None:
    assert message(content_type="application/cloudevents+json").properties.content_type == (
        "application/cloudevents+json")
    assert message(payload=None, payload_bytes=b"x", content_type="text/plain").properties.content_type == (
        "text/plain")


def test_message_carries_the_row_routing() -> None:
    built = message()

    assert (built.row_id, built.message_id, built.exchange, built.routing_key) == (
        7, "evt-7", "events", "order.created")


# -- properties -------------------------------------------------------------------------------


def test_properties_are_persistent_with_message_id_and_timestamp() -> None:
    props = message().properties

    assert props.delivery_mode == 2
    assert props.message_id == "evt-7"
    assert props.timestamp == int(CREATED.timestamp())


def test_empty_headers_are_sent_as_none() -> None:
    assert message(headers={}).properties.headers is None


def test_headers_are_passed_through() -> None:
    headers = {"tenant": "acme", "version": 3, "tags": ["a", "b"], "flag": True, "nested": {"x": None}}

    assert message(headers=headers).properties.headers == headers


# -- short strings ----------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["exchange", "routing_key", "message_id", "content_type"])
def test_short_strings_up_to_255_bytes_are_accepted(field: str) -> None:
    assert isinstance(to_message(row(**{field: "x" * SHORTSTR_MAX}), max_bytes=1000), Message)


@pytest.mark.parametrize("field", ["exchange", "routing_key", "message_id", "content_type"])
def test_short_strings_over_255_bytes_are_refused(field: str) -> None:
    built = to_message(row(**{field: "x" * (SHORTSTR_MAX + 1)}), max_bytes=1000)

    assert built == f"{field} is longer than 255 bytes"


def test_short_string_limit_counts_bytes_not_characters() -> None:
    assert error(routing_key="é" * 128) == "routing_key is longer than 255 bytes"


def test_first_problem_is_reported() -> None:
    assert error(exchange="x" * 300, routing_key="y" * 300, headers=[]) == (
        "exchange is longer than 255 bytes")


# -- headers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("headers", "kind"), [([1, 2], "list"), ("text", "str"), (5, "int"),
                                              (None, "NoneType")])
def test_headers_that_are_not_an_object_are_refused(headers: Any, kind: str) -> None:
    assert error(headers=headers) == f"headers must be a JSON object, got {kind}"


@pytest.mark.parametrize("headers", [{"k" * 256: 1}, {"big": 2**70}, {"big": {"inner": -(2**70)}}])
def test_headers_that_cannot_be_an_amqp_table_are_refused(headers: dict[str, Any]) -> None:
    assert error(headers=headers).startswith("headers cannot be encoded as an AMQP table: ")


def test_headers_with_a_fractional_number_are_published() -> None:
    built = to_message(row(headers={"version": 1.5}), max_bytes=1000)

    assert isinstance(built, Message), built


# -- size limit -------------------------------------------------------------------------------


def test_body_of_exactly_max_bytes_is_accepted() -> None:
    built = to_message(row(payload=None, payload_bytes=b"x" * 100), max_bytes=100)

    assert isinstance(built, Message)


def test_body_over_max_bytes_is_refused_naming_the_setting() -> None:
    assert error(max_bytes=100, payload=None, payload_bytes=b"x" * 101) == (
        "payload of 101 bytes exceeds OUTBOX_MAX_MESSAGE_BYTES=100")


def test_json_body_size_counts_encoded_bytes() -> None:
    payload = '"' + "é" * 50 + '"'  # 52 characters, 102 bytes

    assert error(max_bytes=100, payload=payload) == (
        "payload of 102 bytes exceeds OUTBOX_MAX_MESSAGE_BYTES=100")
