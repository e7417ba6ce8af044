"""The headers' JSON text is measured before it is decoded (issue 32): a table that cannot fit
the broker's frame_max is refused from its text alone, never decoded (jsonb decoded in Python
takes tens of times its text); no table that fits is refused; and a built message holds its
table as bytes only."""

from __future__ import annotations

import json
import random
import tracemalloc
from datetime import datetime, timezone
from typing import Any

import pika.spec
import pytest

from outbox_relay.model import Message, OutboxRow, Unpublishable
from outbox_relay.relay import messages
from outbox_relay.relay.messages import EncodedProperties, to_message
from outbox_relay.rules import (
    HEADER_FRAME_OVERHEAD,
    HEADERS_TEXT_MEASURED_ABOVE,
    amqp_value,
    header_frame_floor,
    headers_text_problem,
    property_fields,
    publish_problem,
)

FRAME_MAX = 131072
CREATED = datetime(2024, 5, 1, tzinfo=timezone.utc)
MIB = 1 << 20


def text_of(table: Any) -> str:
    """JSON text as PostgreSQL prints jsonb: ", " between items, ": " after keys, non-ASCII as
    it is, control characters escaped."""
    return json.dumps(table, ensure_ascii=False)


def row(text: str, *, ordering_key: str | None = None) -> OutboxRow:
    return OutboxRow(7, "evt-7", "events", "order.created", ordering_key, b"{}", True, text,
                     None, CREATED.timestamp(), str(CREATED), 0, len(text))


def frame_size(table: dict[str, Any]) -> int:
    """The header frame pika writes for this table (the relay's other properties: content type
    application/json, message id evt-7)."""
    fields = property_fields("evt-7", "application/json", amqp_value(table), CREATED.timestamp())
    return HEADER_FRAME_OVERHEAD + len(b"".join(pika.spec.BasicProperties(**fields).encode()))


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["null", "bool", "int", "bigint", "float", "str"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    alphabet = 'ab"\\\n\t\x01\x1f é€😀/'
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.randint(-1000, 1000)
    if kind == "bigint":
        return rng.randint(-(1 << 63), (1 << 63) - 1)
    if kind == "float":
        return round(rng.uniform(-1000, 1000), rng.randint(1, 4))
    if kind == "str":
        return "".join(rng.choices(alphabet, k=rng.randint(0, 30)))
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 10))]
    return {"".join(rng.choices(alphabet, k=rng.randint(0, 12))): random_value(rng, depth + 1)
            for _ in range(rng.randint(0, 6))}


def test_the_floor_never_exceeds_the_frame_over_many_random_tables() -> None:
    rng = random.Random(32)
    for _ in range(3000):
        table = {f"k{n}": random_value(rng) for n in range(rng.randint(0, 8))}
        assert header_frame_floor(text_of(table)) <= frame_size(table), table


@pytest.mark.parametrize("keys", [256, 512, 2048])
def test_a_table_that_fits_is_not_refused_where_the_count_stops_early(keys: int) -> None:
    # The count stops once past frame_max, checking every 256 strings: here the 256th string is
    # a key whose value is not read yet, the one place a partial count can exceed the table.
    table = {f"k{n:05d}": None for n in range(keys)}
    fits = frame_size(table) - len("application/json" "evt-7")  # with empty other properties

    assert header_frame_floor(text_of(table), above=fits) <= fits
    assert headers_text_problem(text_of(table), fits) is None
    assert headers_text_problem(text_of(table), fits - 1) is not None


# Tables of many small values: what costs the most to decode, and what the floor measures to
# within the bytes of the properties besides the table (content type, message id).
DENSE = {
    "nulls": {"a": [None] * 20000},
    "booleans": {"a": [True, False] * 10000},
    "zeros": {"a": [0] * 20000},
    "empty objects": {"a": [{}] * 20000},
    "empty arrays": {"a": [[]] * 20000},
    "one-character strings": {"a": ["x"] * 20000},
    "keys": {f"k{n}": 0 for n in range(20000)},
    "control characters": {"a": "\x01" * 20000},
    "mixed": {"a": {"b": [1, "x", None, {"c": True}] * 2000}},
}


@pytest.mark.parametrize("table", DENSE.values(), ids=DENSE.keys())
def test_the_floor_of_dense_tables_is_exact_but_for_the_other_properties(
        table: dict[str, Any]) -> None:
    assert frame_size(table) - header_frame_floor(text_of(table)) == len("application/json evt-7") - 1


def test_a_long_text_of_a_few_numbers_is_measured_by_its_values_not_its_digits() -> None:
    # jsonb keeps a number's trailing zeros: 1.000... decodes to 1.0, six bytes on the wire.
    text = '{"n": 1.' + "0" * 200_000 + "}"
    built = to_message(row(text), max_bytes=1000)

    assert isinstance(built, Message), built


TEN_MIB = {
    "array of zeros": "[" + ", ".join(["0"] * (10 * MIB // 3)) + "]",
    "table of an array of zeros": '{"a": [' + ", ".join(["0"] * (10 * MIB // 3)) + "]}",
    "table of an array of empty objects": '{"a": [' + ", ".join(["{}"] * (10 * MIB // 4)) + "]}",
    "table of nulls": '{"a": [' + ", ".join(["null"] * (10 * MIB // 6)) + "]}",
    "many keys": "{" + ", ".join(f'"k{n}": 0' for n in range(10 * MIB // 12)) + "}",
    "one long string": '{"s": "' + "x" * (10 * MIB) + '"}',
}


@pytest.mark.parametrize("text", TEN_MIB.values(), ids=TEN_MIB.keys())
def test_ten_mib_of_headers_are_refused_without_being_decoded(
        text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def never(_text: str) -> Any:
        raise AssertionError("decoded")
    monkeypatch.setattr(messages, "decode_headers", never)
    tracemalloc.start()
    try:
        built = to_message(row(text), max_bytes=1000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    assert isinstance(built, Unpublishable)
    assert built.reason.endswith(f"over the broker's frame_max of {FRAME_MAX} bytes") or \
        built.reason == "headers must be a JSON object, got list", built.reason
    assert peak < len(text) + MIB  # the text with its strings emptied, at most


# Just under frame_max, in the shapes of the most Python objects per byte.
NEAR_FRAME_MAX = {
    "nulls": {"a": [None] * 130900},
    "empty objects": {"a": [{}] * 26180},
    "empty arrays": {"a": [[]] * 26180},
    "zeros": {"a": [0] * 26180},
    "booleans": {"a": [True] * 65000},
    "keys": {f"k{n:05d}": 0 for n in range(10900)},
    "nested objects": {"a": [{"b": {}}] * 10000},
}


@pytest.mark.parametrize("table", NEAR_FRAME_MAX.values(), ids=NEAR_FRAME_MAX.keys())
def test_tables_just_under_frame_max_are_published_within_a_bounded_decode(
        table: dict[str, Any]) -> None:
    text = text_of(table)
    assert len(text) >= HEADERS_TEXT_MEASURED_ABOVE and frame_size(table) <= FRAME_MAX
    tracemalloc.start()
    try:
        built = to_message(row(text), max_bytes=1000)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert isinstance(built, Message), built
    # docs/reliability.md#memory: decoding and encoding a table take 16 MiB at most, and the
    # message holds its bytes (under frame_max), not the table (held: those bytes, and the
    # encoder's bounded cache of header names, outbox_relay.properties).
    assert peak < 16 * MIB and held < FRAME_MAX + MIB // 2, (peak, held)
    assert built.properties.headers == table
    assert isinstance(built.properties, EncodedProperties)
    assert all(not isinstance(value, dict) for value in vars(built.properties).values())


def test_just_over_frame_max_is_refused_from_the_text() -> None:
    # Nulls, one byte each: the floor is the exact size but for the other properties' bytes.
    over = FRAME_MAX - frame_size({"a": [None] * 130900}) + len("application/json evt-7")

    built = to_message(row(text_of({"a": [None] * (130900 + over)})), max_bytes=1000)

    assert isinstance(built, Unpublishable)
    assert built.reason.startswith("headers make a header frame of at least 131073 bytes")


def test_a_long_text_that_is_no_object_is_refused_as_decoding_would() -> None:
    for text, kind in (("[" + "1, " * 5000 + "1]", "list"), ('"' + "x" * 5000 + '"', "str"),
                       ("1" * 5000, "int"), ("1." + "0" * 5000, "float")):
        built = to_message(row(text), max_bytes=1000)
        assert isinstance(built, Unpublishable) and built.reason == (
            f"headers must be a JSON object, got {kind}"), (kind, built)


def test_the_producer_check_measures_the_headers_text_as_the_relay_does() -> None:
    table = {"a": [{}] * 30000}
    text = text_of(table)
    relay = to_message(row(text, ordering_key=None), max_bytes=1000)

    found = publish_problem(message_id="evt-7", exchange="events", routing_key="order.created",
                            body_size=2, headers=table, max_message_bytes=1000,
                            created_at=CREATED, headers_text=text)

    assert isinstance(relay, Unpublishable) and found is not None
    assert (found.field, found.reason) == ("headers", relay.reason)
