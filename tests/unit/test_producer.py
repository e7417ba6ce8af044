"""The producer API's checks, without a database: an event the relay would dead-letter (or
PostgreSQL could not store) is refused before anything is written, with the relay's own reason
and the field at fault; a good batch is one statement."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

import outbox_relay
from outbox_relay import ConfigError, Event, InvalidEvent, caller, enqueue, enqueue_many
from outbox_relay.model import OutboxRow, Unpublishable
from outbox_relay.relay.messages import to_message

NOW = datetime(2024, 5, 6, 7, 8, 9, tzinfo=timezone.utc)


class FakeCursor:
    """A DB-API cursor that records what it is asked to run."""

    description = None

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def execute(self, query: Any, params: Any = None, /) -> None:
        self.calls.append((query, params))

    def fetchall(self) -> list[Any]:
        return []


def good(**changes: Any) -> dict[str, Any]:
    values: dict[str, Any] = dict(exchange="orders", routing_key="order.paid",
                                  payload={"order_id": 42})
    values.update(changes)
    return values


def refused(**changes: Any) -> InvalidEvent:
    cursor = FakeCursor()
    with pytest.raises(InvalidEvent) as caught:
        enqueue(cursor, **good(**changes))
    assert cursor.calls == []  # nothing written
    return caught.value


def relay_reason(max_bytes: int = outbox_relay.DEFAULT_MAX_MESSAGE_BYTES, *,
                 payload: str | None = '{"order_id": 42}', payload_bytes: bytes | None = None,
                 headers: Any = None, **changes: Any) -> str:
    """What the relay says about a claimed row of these values (it dead-letters the row with it)."""
    body = payload.encode() if payload is not None else bytes(payload_bytes or b"")
    values: dict[str, Any] = dict(id=1, message_id="m", exchange="orders", routing_key="order.paid",
                                  ordering_key=None, body=body, is_json=payload is not None,
                                  headers=json.dumps({} if headers is None else headers),
                                  content_type=None, created_epoch=NOW.timestamp(),
                                  created_at=NOW.isoformat(), attempts=0)
    values.update(changes)
    built = to_message(OutboxRow(**values), max_bytes=max_bytes, ledger_stream="outbox.ledger")
    assert isinstance(built, Unpublishable), built
    return built.reason


# -- the relay's rules, the relay's reasons ---------------------------------------------------


@pytest.mark.parametrize("field", ["exchange", "routing_key", "message_id", "content_type"])
def test_a_short_string_over_255_bytes_is_refused_with_the_relays_reason(field: str) -> None:
    error = refused(**{field: "é" * 128})  # 128 characters, 256 bytes

    assert error.field == field
    assert error.reason == relay_reason(**{field: "é" * 128}) == f"{field} is longer than 255 bytes"
    assert str(error) == f"{field}: {field} is longer than 255 bytes"
    assert isinstance(error, outbox_relay.OutboxError) and isinstance(error, ValueError)


@pytest.mark.parametrize("field", ["exchange", "routing_key", "message_id", "content_type"])
def test_a_short_string_of_255_bytes_is_accepted(field: str) -> None:
    cursor = FakeCursor()
    enqueue(cursor, **good(**{field: "x" * 255}))
    assert len(cursor.calls) == 1


@pytest.mark.parametrize("headers", [{"big": 2**70}, {"k" * 256: 1}, {"deep": {"er": -(2**70)}}])
def test_headers_that_are_no_amqp_table_are_refused_with_the_relays_reason(
        headers: dict[str, Any]) -> None:
    error = refused(headers=headers)

    assert error.field == "headers"
    assert error.reason == relay_reason(headers=headers)
    assert error.reason.startswith("headers cannot be encoded as an AMQP table")


def test_a_json_payload_over_the_limit_is_refused_with_the_relays_reason() -> None:
    payload = {"text": "é" * 50}
    text = json.dumps(payload, ensure_ascii=False)
    limit = len(text.encode()) - 1
    cursor = FakeCursor()
    with pytest.raises(InvalidEvent) as caught:
        enqueue(cursor, **good(payload=payload), max_message_bytes=limit)

    assert caught.value.field == "payload"
    assert caught.value.reason == relay_reason(limit, payload=text) == (
        f"payload of {limit + 1} bytes exceeds OUTBOX_MAX_MESSAGE_BYTES={limit}")
    enqueue(cursor, **good(payload=payload), max_message_bytes=limit + 1)
    assert len(cursor.calls) == 1


def test_a_bytes_payload_over_the_limit_is_refused() -> None:
    with pytest.raises(InvalidEvent, match="payload of 11 bytes exceeds"):
        enqueue(FakeCursor(), **good(payload=b"x" * 11), max_message_bytes=10)
    enqueue(FakeCursor(), **good(payload=b"x" * 10), max_message_bytes=10)


def test_the_default_limit_is_the_relays_default() -> None:
    from outbox_relay.relay.settings import RelaySettings

    assert outbox_relay.DEFAULT_MAX_MESSAGE_BYTES == RelaySettings.max_message_bytes == 4 * 1024 * 1024


def test_the_headers_of_a_keyed_event_are_checked_as_the_relay_will_send_them() -> None:
    # A header table that fits alone: the relay adds x-ordering-key and x-outbox-id to it.
    cursor = FakeCursor()
    enqueue(cursor, **good(ordering_key="order-42", headers={"tenant": "acme"}))
    assert len(cursor.calls) == 1


@pytest.mark.parametrize("ordering_key", [None, "order-42"])
@pytest.mark.parametrize("name", ["x-ordering-key", "x-outbox-id"])
def test_the_relays_own_headers_are_refused(name: str, ordering_key: str | None) -> None:
    # The relay dead-letters such a row, with a key or without: one rule, one reason.
    error = refused(headers={name: "forged"}, ordering_key=ordering_key)

    assert error.field == "headers"
    assert error.reason == relay_reason(headers={name: "forged"}, ordering_key=ordering_key)
    assert "set by the relay" in error.reason


# -- what PostgreSQL could not store, or what is not the API's types ---------------------------


@pytest.mark.parametrize("field", ["exchange", "routing_key", "message_id", "ordering_key",
                                   "content_type"])
def test_text_with_a_nul_character_is_refused(field: str) -> None:
    assert refused(**{field: "a\x00b"}).field == field


def test_text_that_is_not_utf8_is_refused() -> None:
    error = refused(routing_key="\ud800")

    assert error.field == "routing_key" and "UTF-8" in error.reason


@pytest.mark.parametrize(("field", "value"), [("exchange", None), ("routing_key", 5),
                                              ("message_id", 7), ("ordering_key", b"k")])
def test_a_value_of_the_wrong_type_is_refused(field: str, value: Any) -> None:
    error = refused(**{field: value})

    assert error.field == field and "must be a str" in error.reason


@pytest.mark.parametrize("payload", [{1, 2}, object(), float("nan"), {"x": float("inf")},
                                     {"amount": b"bytes"}, {uuid.UUID(int=1): "a key"}])
def test_a_payload_that_is_not_json_is_refused(payload: Any) -> None:
    error = refused(payload=payload)

    assert error.field == "payload" and "not JSON-serializable" in error.reason


def test_an_object_no_encoding_knows_is_refused_with_a_pointer_to_the_hook() -> None:
    error = refused(payload={"n": {1, 2}})

    assert error.reason == ("is not JSON-serializable: Object of type set is not JSON "
                            "serializable (json_default= can encode it)")


def test_a_json_payload_holding_nul_is_refused_but_an_escaped_backslash_u0000_is_not() -> None:
    assert refused(payload={"t": "a\x00"}).field == "payload"
    assert refused(payload={"k\x00": 1}).field == "payload"
    cursor = FakeCursor()
    enqueue(cursor, **good(payload={"t": "\\u0000"}))  # a backslash, then "u0000": fine
    assert len(cursor.calls) == 1


def test_a_deeply_nested_payload_is_refused() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    assert refused(payload=deep).field == "payload"


@pytest.mark.parametrize(("headers", "words"), [
    ([("a", 1)], "must be a mapping"), ({1: "a"}, "keys must be str"),
    ({"n": float("nan")}, "not JSON-serializable"), ({"t": "\x00"}, "NUL"),
])
def test_headers_that_are_not_a_json_object_are_refused(headers: Any, words: str) -> None:
    error = refused(headers=headers)

    assert error.field == "headers" and words in error.reason


def test_a_naive_available_at_is_refused() -> None:
    error = refused(available_at=datetime(2030, 1, 1))

    assert error.field == "available_at" and "timezone-aware" in error.reason


def test_an_available_at_never_due_is_refused() -> None:
    # 9999-12-31 23:00 at UTC-14 is the year 10000 in UTC: the relay would dead-letter it.
    late = datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-14)))
    error = refused(available_at=late)

    assert error.field == "available_at"
    assert error.reason == ("available_at 9999-12-31T23:00:00-14:00 is never due (a date before "
                            "the year 10000 is required)")
    cursor = FakeCursor()  # the last day of 9999 is a schedule
    enqueue(cursor, **good(available_at=datetime(9999, 12, 31, tzinfo=timezone.utc)))
    assert len(cursor.calls) == 1


def test_a_bad_table_name_is_a_config_error() -> None:
    for table in ('outbox"; DROP TABLE users; --', "a.b.c", "", 5):
        with pytest.raises(ConfigError):
            enqueue(FakeCursor(), **good(), table=table)  # type: ignore[arg-type]


def test_an_object_that_runs_no_sql_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="psycopg connection"):
        enqueue(object(), **good())  # type: ignore[call-overload]


# -- what is written --------------------------------------------------------------------------


CORRELATION = uuid.UUID("5f0c7f7e-3b1a-4c52-9d7e-2f4f0f3a9b11")


def test_one_event_is_one_statement_with_its_values() -> None:
    cursor = FakeCursor()
    at = NOW + timedelta(minutes=5)
    message_id = enqueue(cursor, exchange="orders", routing_key="order.paid", payload={"a": 1.5},
                         ordering_key="order-42", headers={"tenant": "acme"},
                         content_type="application/vnd.order+json", available_at=at,
                         message_type="order.paid.v1", correlation_id=CORRELATION)

    [(query, params)] = cursor.calls
    assert isinstance(query, str) and query.lstrip().startswith('INSERT INTO "outbox"')
    assert params == {
        "message_id": [message_id], "exchange": ["orders"], "routing_key": ["order.paid"],
        "ordering_key": ["order-42"], "payload": ['{"a": 1.5}'], "payload_bytes": [None],
        "headers": ['{"tenant": "acme"}'], "content_type": ["application/vnd.order+json"],
        "message_type": ["order.paid.v1"], "correlation_id": [str(CORRELATION)],
        "available_at": [at],
    }
    assert uuid.UUID(message_id).version == 4


def test_bytes_go_to_payload_bytes_and_a_str_is_a_json_string() -> None:
    cursor = FakeCursor()
    enqueue_many(cursor, [Event("", "q", b"\x00raw"), Event("", "q", bytearray(b"ba")),
                          Event("", "q", memoryview(b"mv")), Event("", "q", "text"),
                          Event("", "q", None)], table="app.events")

    [(query, params)] = cursor.calls
    assert 'INSERT INTO "app"."events"' in query
    assert params["payload_bytes"] == [b"\x00raw", b"ba", b"mv", None, None]
    assert params["payload"] == [None, None, None, '"text"', "null"]


def test_a_batch_is_one_statement_and_keeps_the_given_ids_in_order() -> None:
    cursor = FakeCursor()
    events = [Event("orders", "order.paid", {"n": n}, message_id=f"m-{n}") for n in range(500)]

    ids = enqueue_many(cursor, events)

    assert ids == [f"m-{n}" for n in range(500)]
    assert len(cursor.calls) == 1
    assert cursor.calls[0][1]["message_id"] == ids
    assert "WITH ORDINALITY" in cursor.calls[0][0] and "ORDER BY n" in cursor.calls[0][0]


def test_a_bad_event_of_a_batch_names_its_index_and_nothing_is_written() -> None:
    cursor = FakeCursor()
    events = [Event("", "q", 1), Event("", "q", 2), Event("", "r" * 300, 3)]
    with pytest.raises(InvalidEvent) as caught:
        enqueue_many(cursor, events)

    assert (caught.value.index, caught.value.field) == (2, "routing_key")
    assert str(caught.value).startswith("event 2: routing_key: ")
    assert cursor.calls == []


def test_a_message_id_twice_in_a_batch_is_refused() -> None:
    with pytest.raises(InvalidEvent) as caught:
        enqueue_many(FakeCursor(), [Event("", "q", 1, message_id="a"), Event("", "q", 2),
                                    Event("", "q", 3, message_id="a")])
    assert (caught.value.index, caught.value.field) == (2, "message_id")


def test_an_empty_batch_writes_nothing() -> None:
    cursor = FakeCursor()
    assert enqueue_many(cursor, []) == []
    assert cursor.calls == []


def test_the_statement_reads_the_same_for_sqlalchemy() -> None:
    from outbox_relay.producer import _statement

    statement = _statement("app.events")
    assert "%(" not in statement.sqlalchemy_text and "::" not in statement.sqlalchemy_text
    assert "CAST(:message_id AS text[])" in statement.sqlalchemy_text
    assert caller.Kind.SQLALCHEMY_ASYNC.is_async and not caller.Kind.DBAPI.is_async


def test_the_schema_is_importable_for_migration_tools() -> None:
    from outbox_relay.schema import schema_sql

    assert outbox_relay.schema_sql() == schema_sql("outbox")
    assert 'CREATE TABLE IF NOT EXISTS "app"."events"' in outbox_relay.schema_sql("app.events")
    assert 'CREATE TABLE IF NOT EXISTS "inbox"' in outbox_relay.inbox_schema_sql()
    assert '"billing"."inbox_keys"' in outbox_relay.inbox_schema_sql("billing.inbox")
    with pytest.raises(ConfigError):
        outbox_relay.schema_sql("bad name")
