"""Claimed rows to AMQP messages: bodies, content types, properties, and rows never publishable."""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from typing import Any

import pika.frame
import pytest

from outbox_relay.model import Message, OutboxRow, Unpublishable
from outbox_relay.relay.messages import to_message
from outbox_relay.rules import (
    HEADERS_DEPTH_MAX,
    ORDERING_KEY_HEADER,
    POSITION_HEADER,
    SHORTSTR_MAX,
    message_headers,
    publish_problem,
)

CREATED = datetime(2024, 5, 6, 7, 8, 9, tzinfo=timezone.utc)
_MISSING = object()


def row(*, payload: str | None = '{"total": 12}', payload_bytes: Any = None,
        headers: Any = _MISSING, raw_headers: str | None = None,
        created_at: datetime | None = None, created_epoch: float | None = None,
        created_text: str | None = None, **changes: Any) -> OutboxRow:
    """A claimed row as the claim fetches it, from convenient values."""
    if payload_bytes is not None:
        body, is_json = bytes(payload_bytes), False
    else:
        body, is_json = (payload or "").encode(), True
    text = raw_headers if raw_headers is not None else json.dumps(
        {} if headers is _MISSING else headers)
    stamp = created_at or CREATED
    values: dict[str, Any] = dict(
        id=7, message_id="evt-7", exchange="events", routing_key="order.created",
        ordering_key="order-1", body=body, is_json=is_json, headers=text, content_type=None,
        created_epoch=stamp.timestamp() if created_epoch is None else created_epoch,
        created_at=created_text or stamp.isoformat(sep=" "), attempts=0)
    values.update(changes)
    return OutboxRow(**values)


def message(**changes: Any) -> Message:
    built = to_message(row(**changes), max_bytes=1000)
    assert isinstance(built, Message), built
    return built


def error(max_bytes: int = 1000, frame_max: int = 131072, ledger_stream: str | None = None,
          **changes: Any) -> str:
    built = to_message(row(**changes), max_bytes=max_bytes, frame_max=frame_max,
                       ledger_stream=ledger_stream)
    assert isinstance(built, Unpublishable), built
    return built.reason


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


def test_empty_headers_of_a_row_without_ordering_key_are_sent_as_none() -> None:
    assert message(headers={}, ordering_key=None).properties.headers is None


def test_headers_are_passed_through() -> None:
    headers = {"tenant": "acme", "version": 3, "tags": ["a", "b"], "flag": True, "nested": {"x": None}}

    assert message(headers=headers, ordering_key=None).properties.headers == headers


def test_a_row_with_an_ordering_key_carries_the_key_and_its_id_as_headers() -> None:
    headers = message(headers={"tenant": "acme"}).properties.headers

    assert headers == {"tenant": "acme", ORDERING_KEY_HEADER: "order-1", POSITION_HEADER: 7}
    assert (ORDERING_KEY_HEADER, POSITION_HEADER) == ("x-ordering-key", "x-outbox-id")


@pytest.mark.parametrize("ordering_key", ["order-1", None])
@pytest.mark.parametrize("own", [
    {ORDERING_KEY_HEADER: "order-1", POSITION_HEADER: 2**63 - 1},
    {POSITION_HEADER: 1}, {"tenant": "a", ORDERING_KEY_HEADER: "forged"},
    {ORDERING_KEY_HEADER: None}])
def test_a_row_may_not_set_the_relays_headers(own: dict[str, Any],
                                             ordering_key: str | None) -> None:
    # A keyless row carrying them was published with the producer's values, and a consumer's
    # per-key check (the inbox) then skipped every later event of that key (issue 32).
    reason = error(headers=own, ordering_key=ordering_key)

    name = ORDERING_KEY_HEADER if ORDERING_KEY_HEADER in own else POSITION_HEADER
    assert reason == (f"header {name} is set by the relay (from ordering_key and the row's "
                      "id); a row may not set it")


def test_headers_named_like_the_relays_in_another_case_are_the_rows_own() -> None:
    # AMQP header names are case-sensitive: the inbox reads only the relay's exact names.
    headers = {"X-Outbox-Id": 1, "x-ordering-key ": "k"}

    assert message(headers=headers, ordering_key=None).properties.headers == headers


def test_message_headers_leave_what_is_not_an_object_to_the_checks() -> None:
    assert message_headers([1], "k", 1) == [1]
    assert error(headers=[1]) == "headers must be a JSON object, got list"


# -- short strings ----------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["exchange", "routing_key", "message_id", "content_type"])
def test_short_strings_up_to_255_bytes_are_accepted(field: str) -> None:
    assert isinstance(to_message(row(**{field: "x" * SHORTSTR_MAX}), max_bytes=1000), Message)


@pytest.mark.parametrize("field", ["exchange", "routing_key", "message_id", "content_type"])
def test_short_strings_over_255_bytes_are_refused(field: str) -> None:
    built = to_message(row(**{field: "x" * (SHORTSTR_MAX + 1)}), max_bytes=1000)

    assert built == Unpublishable(f"{field} is longer than 255 bytes")


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


# -- hostile rows: decoded and refused one row at a time -------------------------------------


def nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


@pytest.mark.parametrize("depth", [HEADERS_DEPTH_MAX + 1, 1000, 5000, 100_000])
def test_deeply_nested_headers_are_refused_never_raised(depth: int) -> None:
    reason = error(raw_headers=nested(depth))

    # 100,000 levels make a table over frame_max: refused from the text, never decoded.
    assert "nested" in reason if depth < 100_000 else "frame_max of 131072" in reason


def test_headers_nested_up_to_the_limit_are_published() -> None:
    built = to_message(row(raw_headers=nested(HEADERS_DEPTH_MAX - 1)), max_bytes=1000)

    assert isinstance(built, Message), built


def test_deep_arrays_in_headers_are_refused() -> None:
    assert "nested" in error(raw_headers='{"a":' + "[" * 3000 + "]" * 3000 + "}")


@pytest.mark.parametrize(("epoch", "text"), [
    (float("inf"), "infinity"), (float("-inf"), "-infinity"),
    (-210863520000.0, "4713-01-01 00:00:00+00 BC"), (253402300800.0, "10000-01-01 00:00:00+00"),
    (-1.0, "1969-12-31 23:59:59+00"), (float("nan"), "nan"),
])
def test_created_at_that_cannot_be_an_amqp_timestamp_is_refused_naming_it(
        epoch: float, text: str) -> None:
    reason = error(created_epoch=epoch, created_text=text)

    assert reason.startswith(f"created_at {text!r} cannot be an AMQP timestamp")


def test_created_at_up_to_the_last_second_of_9999_is_published() -> None:
    built = to_message(row(created_epoch=253402300799.5, created_text="9999-12-31 23:59:59.5+00"),
                       max_bytes=1000)

    assert isinstance(built, Message) and built.properties.timestamp == 253402300799


def test_unix_epoch_is_a_valid_timestamp() -> None:
    built = to_message(row(created_epoch=0.0), max_bytes=1000)

    assert isinstance(built, Message) and built.properties.timestamp == 0


def test_headers_whose_frame_exceeds_frame_max_are_refused() -> None:
    reason = error(headers={"big": "x" * 5000}, frame_max=4096)

    assert reason.startswith("headers make a header frame of ")
    assert reason.endswith("over the broker's frame_max of 4096 bytes")


def test_header_frame_limit_is_exact() -> None:
    headers = {"h": "x" * 3000}
    built = to_message(row(headers=headers), max_bytes=1000)
    assert isinstance(built, Message)
    size = len(pika.frame.Header(1, len(built.body), built.properties).marshal())

    assert isinstance(to_message(row(headers=headers), max_bytes=1000, frame_max=size), Message)
    assert isinstance(to_message(row(headers=headers), max_bytes=1000, frame_max=size - 1),
                      Unpublishable)


@pytest.mark.parametrize("key", ["k" * 131_000, "\U0001F511" * 40_000, "k" * 200_000])
def test_an_ordering_key_whose_frame_exceeds_frame_max_is_refused(key: str) -> None:
    # The relay's own headers are measured only when the key might not fit (a producer's key
    # is a text column of any length): a frame over frame_max closes the broker connection.
    assert "over the broker's frame_max of 131072 bytes" in error(ordering_key=key)


@pytest.mark.parametrize("key", ["k" * 30_000, "\U0001F511" * 32_000, "k" * 130_000])
def test_an_ordering_key_that_fits_the_frame_is_published(key: str) -> None:
    built = to_message(row(ordering_key=key, headers={}), max_bytes=1000)
    assert isinstance(built, Message)
    assert len(pika.frame.Header(1, len(built.body), built.properties).marshal()) <= 131072


@pytest.mark.parametrize("text", ["not json", '{"a": 1', '{"a": NaN}'])
def test_undecodable_headers_are_refused(text: str) -> None:
    assert error(raw_headers=text).startswith("headers cannot be ")


@pytest.mark.parametrize("headers", [{"f": 1e300}, {"f": 0.12345678901234567}])
def test_numbers_pika_cannot_encode_are_refused(headers: dict[str, Any]) -> None:
    assert error(headers=headers).startswith("headers cannot be encoded as an AMQP table")


@pytest.mark.parametrize(("exchange", "routing_key"), [
    ("", "outbox.ledger"), ("outbox.ledger", "anything"), ("outbox.ledger", "outbox.ledger")])
def test_rows_addressed_to_the_ledger_are_refused(exchange: str, routing_key: str) -> None:
    reason = error(exchange=exchange, routing_key=routing_key, ledger_stream="outbox.ledger")

    assert reason.startswith("addressed to the ledger stream 'outbox.ledger'")


def test_rows_for_other_queues_on_the_default_exchange_are_published() -> None:
    built = to_message(row(exchange="", routing_key="outbox.ledger.copy"), max_bytes=1000,
                       ledger_stream="outbox.ledger")

    assert isinstance(built, Message)


# -- the same rules from plain values (the producer-side check) ------------------------------


def plain(**changes: Any) -> str | None:
    """publish_problem's reason (the field it names is checked below)."""
    values: dict[str, Any] = dict(message_id="m", exchange="events", routing_key="k",
                                  body_size=10, max_message_bytes=1000)
    values.update(changes)
    found = publish_problem(**values)
    return None if found is None else found.reason


def test_publish_problem_accepts_a_plain_row() -> None:
    assert plain() is None
    assert plain(headers={"tenant": "acme"}, created_at=CREATED, content_type="text/plain") is None


@pytest.mark.parametrize(("changes", "start"), [
    ({"routing_key": "k" * 256}, "routing_key is longer than 255 bytes"),
    ({"headers": [1]}, "headers must be a JSON object"),
    ({"headers": json.loads(nested(200))}, "headers are nested deeper"),
    ({"body_size": 1001}, "payload of 1001 bytes exceeds"),
    ({"created_at": datetime(1960, 1, 1, tzinfo=timezone.utc)}, "created_at "),
    ({"created_at": float("inf")}, "created_at inf cannot be"),
    ({"headers": {"h": "x" * 200_000}}, "headers make a header frame"),
    ({"exchange": "", "routing_key": "the.ledger", "ledger_stream": "the.ledger"},
     "addressed to the ledger"),
])
def test_publish_problem_names_what_the_relay_would_dead_letter(changes: dict[str, Any],
                                                                start: str) -> None:
    problem = plain(**changes)

    assert problem is not None and problem.startswith(start), problem


@pytest.mark.parametrize(("changes", "field"), [
    ({"exchange": "e" * 256}, "exchange"),
    ({"routing_key": "k" * 256}, "routing_key"),
    ({"message_id": "m" * 256}, "message_id"),
    ({"content_type": "c" * 256}, "content_type"),
    ({"headers": [1]}, "headers"),
    ({"headers": {"big": 2**70}}, "headers"),
    ({"body_size": 1001}, "payload"),
    ({"created_at": float("inf")}, "created_at"),
    ({"exchange": "", "routing_key": "the.ledger", "ledger_stream": "the.ledger"}, "routing_key"),
    ({"exchange": "the.ledger", "ledger_stream": "the.ledger"}, "exchange"),
])
def test_publish_problem_names_the_field_at_fault(changes: dict[str, Any], field: str) -> None:
    values: dict[str, Any] = dict(message_id="m", exchange="events", routing_key="k",
                                  body_size=10, max_message_bytes=1000)
    found = publish_problem(**{**values, **changes})

    assert found is not None and found.field == field, found


def figures_apart(reason: str | None) -> str | None:
    return None if reason is None else re.sub(r"\d+", "N", reason)


def test_publish_problem_agrees_with_to_message() -> None:
    for headers in ({"ok": 1}, {"big": 2**70}, {"k" * 256: 1}, [], {"h": "x" * 200_000},
                    {POSITION_HEADER: 1}, {ORDERING_KEY_HEADER: "k", "k" * 256: 1}):
        for key in ("order-1", None):
            built = to_message(row(headers=headers, ordering_key=key), max_bytes=1000)
            expected = built.reason if isinstance(built, Unpublishable) else None
            # Both take the row's own headers and its ordering key, and add the relay's
            # headers to measure the header frame: the producer with the largest id, so a
            # frame's size may differ by the id's few bytes, never the verdict.
            # A producer's headers' JSON text is measured as the relay measures the column's.
            found = plain(headers=headers, ordering_key=key, body_size=len(b'{"total": 12}'),
                          message_id="evt-7", routing_key="order.created", created_at=CREATED,
                          headers_text=json.dumps(headers))
            assert figures_apart(found) == figures_apart(expected), (headers, key)


def test_publish_problem_measures_a_keyed_event_with_the_relays_headers() -> None:
    # A header frame of 131,061 bytes alone (with the longest user_id), 131,072 at most: no
    # room for the relay's two.
    fits = {"h": "x" * 130_744}
    frame = publish_problem(message_id="m", exchange="e", routing_key="r", body_size=1,
                            headers=fits, max_message_bytes=10)
    keyed = publish_problem(message_id="m", exchange="e", routing_key="r", body_size=1,
                            headers=fits, ordering_key="k" * 100, max_message_bytes=10)

    assert frame is None
    assert keyed is not None and keyed.reason.startswith("headers make a header frame")


def test_publish_problem_measures_the_frame_with_the_longest_user_id() -> None:
    # The relay sets user_id to its connection's user (up to 255 bytes): a producer cannot know
    # it, so its check leaves room for the longest; the relay's own is exact.
    headers = {"h": "x" * 130_800}
    found = publish_problem(message_id="evt-7", exchange="events", routing_key="order.created",
                            body_size=13, headers=headers, created_at=CREATED,
                            max_message_bytes=1000)
    for user_id in (None, "outbox-relay", "u" * 255):
        built = to_message(row(headers=headers, ordering_key=None), max_bytes=1000,
                           user_id=user_id)
        assert isinstance(built, Message) == (user_id != "u" * 255), user_id
    assert found is not None and found.reason.startswith("headers make a header frame of 131121 bytes")


@pytest.mark.parametrize("key", [None, "order-1", "", "ключ-€-😀", "k" * 300])
@pytest.mark.parametrize("row_id", [7, (1 << 31) - 1, 1 << 31, (1 << 63) - 1])
def test_a_row_without_headers_of_its_own_is_built_as_a_decoded_empty_object_is(
        key: str | None, row_id: int) -> None:
    # Most rows carry the column's default '{}': they skip the JSON decoder and the checks a
    # producer's headers need, and must come out exactly as '{ }' (decoded) does.
    quick = message(raw_headers="{}", ordering_key=key, id=row_id)
    decoded = message(raw_headers="{ }", ordering_key=key, id=row_id)

    assert quick.properties.headers == decoded.properties.headers
    assert (pika.frame.Header(1, 9, quick.properties).marshal()
            == pika.frame.Header(1, 9, decoded.properties).marshal())
