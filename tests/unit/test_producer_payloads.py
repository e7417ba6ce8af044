"""What a service's payloads hold beyond JSON's own types: datetimes, dates, times, Decimals,
UUIDs and Enums are written as DjangoJSONEncoder writes them (plain strings any consumer
reads), a UUID is taken as a message id, and ``json_default`` encodes the rest (dataclasses,
pydantic models). The relay's checks and jsonb's limits still apply to what was encoded."""

from __future__ import annotations

import dataclasses
import enum
import json
import uuid
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
from django.core.serializers.json import DjangoJSONEncoder

from outbox_relay import Event, InvalidEvent, enqueue, enqueue_many
from tests.unit.test_producer import FakeCursor, good, refused

UTC = timezone.utc


class Status(enum.Enum):
    PAID = "paid"
    REFUNDED = "refunded"


class Priority(enum.IntEnum):
    HIGH = 1


class Tier(str, enum.Enum):
    GOLD = "gold"


class Keyed(enum.Enum):
    ONE = uuid.UUID(int=1)  # a value that is itself encoded


class Nul(enum.Enum):
    NUL = "a\x00b"


class Ratio(enum.Enum):
    UNKNOWN = float("nan")


@dataclasses.dataclass
class Line:
    sku: str
    price: Decimal


@dataclasses.dataclass
class Paid:
    order_id: uuid.UUID
    at: datetime
    lines: list[Line]


def written(payload: Any, **options: Any) -> str:
    """The JSON text enqueue writes into the payload column for ``payload``."""
    cursor = FakeCursor()
    enqueue(cursor, **good(payload=payload), **options)
    [(_, params)] = cursor.calls
    text: str = params["payload"][0]
    return text


@pytest.mark.parametrize(("value", "text"), [
    (datetime(2024, 5, 6, 7, 8, 9, tzinfo=UTC), '"2024-05-06T07:08:09Z"'),
    (datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=UTC), '"2024-05-06T07:08:09.123456Z"'),
    (datetime(2024, 5, 6, 7, 8, 9, tzinfo=timezone(timedelta(hours=2))),
     '"2024-05-06T07:08:09+02:00"'),
    (datetime(2024, 5, 6, 7, 8, 9), '"2024-05-06T07:08:09"'),  # naive: as it is
    (date(2024, 5, 6), '"2024-05-06"'),
    (time(7, 8, 9, 500), '"07:08:09.000500"'),
    (Decimal("19.90"), '"19.90"'),
    (Decimal("1E+3"), '"1E+3"'),
    (uuid.UUID("12345678-1234-5678-1234-567812345678"), '"12345678-1234-5678-1234-567812345678"'),
    (Status.PAID, '"paid"'),
    (Priority.HIGH, "1"),
    (Tier.GOLD, '"gold"'),
    (Keyed.ONE, '"00000000-0000-0000-0000-000000000001"'),
])
def test_each_type_is_written_as_a_plain_json_value(value: Any, text: str) -> None:
    assert written(value) == text
    assert written({"nested": [value]}) == f'{{"nested": [{text}]}}'


@pytest.mark.parametrize("value", [
    datetime(2024, 5, 6, 7, 8, 9, tzinfo=UTC),
    datetime(2024, 5, 6, 7, 8, 9, tzinfo=timezone(timedelta(hours=-5))),
    datetime(2024, 5, 6, 7, 8, 9), date(2024, 5, 6), time(7, 8, 9),
    Decimal("19.90"), Decimal("-0.000001"), uuid.UUID(int=2**100),
])
def test_the_text_is_djangos(value: Any) -> None:
    assert written(value) == json.dumps(value, cls=DjangoJSONEncoder)


def test_unlike_django_a_datetime_keeps_its_microseconds() -> None:
    at = datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)

    assert json.dumps(at, cls=DjangoJSONEncoder) == '"2024-05-06T07:08:09.123Z"'
    assert written(at) == '"2024-05-06T07:08:09.123456Z"'
    assert datetime.fromisoformat(json.loads(written(at)).replace("Z", "+00:00")) == at


def test_a_uuid_message_id_is_its_string() -> None:
    cursor = FakeCursor()
    chosen = uuid.uuid4()

    assert enqueue(cursor, **good(message_id=chosen)) == str(chosen)
    ids = enqueue_many(cursor, [Event("", "q", 1, message_id=uuid.UUID(int=7)),
                                Event("", "q", 2, message_id="plain")])
    assert ids == ["00000000-0000-0000-0000-000000000007", "plain"]
    assert cursor.calls[0][1]["message_id"] == [str(chosen)]
    assert cursor.calls[1][1]["message_id"] == ids


def test_a_uuid_and_its_string_are_one_message_id_in_a_batch() -> None:
    same = uuid.uuid4()
    with pytest.raises(InvalidEvent) as caught:
        enqueue_many(FakeCursor(), [Event("", "q", 1, message_id=same),
                                    Event("", "q", 2, message_id=str(same))])
    assert (caught.value.index, caught.value.field) == (1, "message_id")


def test_headers_are_encoded_as_the_payload() -> None:
    cursor = FakeCursor()
    enqueue(cursor, **good(headers={"tenant": uuid.UUID(int=3), "status": Status.PAID,
                                    "at": date(2024, 1, 2)}))
    [(_, params)] = cursor.calls
    assert json.loads(params["headers"][0]) == {
        "tenant": "00000000-0000-0000-0000-000000000003", "status": "paid", "at": "2024-01-02"}


# -- json_default, for the rest ---------------------------------------------------------------


def test_json_default_encodes_a_dataclass_whose_fields_are_then_encoded_as_usual() -> None:
    paid = Paid(uuid.UUID(int=9), datetime(2024, 5, 6, tzinfo=UTC), [Line("A-1", Decimal("2.50"))])

    text = written(paid, json_default=dataclasses.asdict)

    assert json.loads(text) == {"order_id": "00000000-0000-0000-0000-000000000009",
                                "at": "2024-05-06T00:00:00Z",
                                "lines": [{"sku": "A-1", "price": "2.50"}]}


def test_json_default_sees_only_what_the_built_in_encoding_does_not_handle() -> None:
    seen: list[Any] = []

    def hook(value: Any) -> Any:
        seen.append(value)
        return sorted(value)

    assert written({"at": date(2024, 1, 1), "tags": {"b", "a"}, "n": Decimal(1)},
                   json_default=hook) == '{"at": "2024-01-01", "tags": ["a", "b"], "n": "1"}'
    assert seen == [{"a", "b"}]


def test_json_default_applies_to_every_event_of_a_batch_and_to_headers() -> None:
    cursor = FakeCursor()
    enqueue_many(cursor, [Event("", "q", {"tags": {"x"}}), Event("", "q", [1], headers={"t": {"y"}})],
                 json_default=list)
    [(_, params)] = cursor.calls
    assert params["payload"] == ['{"tags": ["x"]}', "[1]"]
    assert params["headers"] == ["{}", '{"t": ["y"]}']


def test_what_json_default_returns_is_checked_as_any_payload() -> None:
    assert refused(payload={1, 2}, json_default=lambda _: float("nan")).field == "payload"
    assert "NUL" in refused(payload={1, 2}, json_default=lambda _: "a\x00").reason
    assert "Circular reference" in refused(payload={1, 2}, json_default=lambda v: v).reason

    def unsupported(value: Any) -> Any:
        raise TypeError(f"no encoding for {type(value).__name__}")

    assert refused(payload={"a": {1}}, json_default=unsupported).reason == (
        "is not JSON-serializable: no encoding for set")


def test_json_default_must_be_callable() -> None:
    with pytest.raises(TypeError, match="json_default must be callable"):
        enqueue(FakeCursor(), **good(), json_default="isoformat")


# -- jsonb's limits and the relay's checks after encoding --------------------------------------


def test_jsonbs_limits_hold_for_encoded_values() -> None:
    assert "NUL" in refused(payload={"status": Status.PAID, "k": Nul.NUL}).reason
    assert refused(payload={"ratio": Ratio.UNKNOWN}).reason.startswith(
        "is not JSON-serializable: Out of range float values are not JSON compliant")
    # A Decimal that is not a number is a string, which jsonb holds.
    assert written({"x": Decimal("NaN"), "y": Decimal("-Infinity")}) == (
        '{"x": "NaN", "y": "-Infinity"}')


def test_the_size_limit_counts_the_encoded_text() -> None:
    payload = [Decimal("1.00")] * 10  # ["1.00", ...]: 10 * 6 + 9 * 2 + 2 bytes
    size = len(json.dumps(["1.00"] * 10))
    assert size == 80
    error = refused(payload=payload, max_message_bytes=size - 1)
    assert error.field == "payload"
    assert error.reason == f"payload of {size} bytes exceeds OUTBOX_MAX_MESSAGE_BYTES={size - 1}"
    assert written(payload, max_message_bytes=size) == json.dumps(["1.00"] * 10)
