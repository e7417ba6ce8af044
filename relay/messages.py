"""Turn claimed rows into AMQP messages, or say why a row can never be published."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pika
import pika.data

from relay.publisher import Message
from relay.store import OutboxRow

SHORTSTR_MAX = 255  # AMQP short strings: exchange, routing key, message id, content type


def _shortstr(name: str, value: str) -> str | None:
    if len(value.encode()) > SHORTSTR_MAX:
        return f"{name} is longer than {SHORTSTR_MAX} bytes"
    return None


def amqp_value(value: Any) -> Any:
    """JSON to AMQP table values: pika encodes no floats, so a fractional number is a decimal."""
    if isinstance(value, float):
        return Decimal(repr(value))
    if isinstance(value, dict):
        return {k: amqp_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [amqp_value(v) for v in value]
    return value


def _headers_error(headers: Any) -> str | None:
    if not isinstance(headers, dict):
        return f"headers must be a JSON object, got {type(headers).__name__}"
    if not headers:
        return None  # the common case; encoding an empty table cannot fail
    try:
        pika.data.encode_table([], amqp_value(headers))
    except Exception as exc:
        return f"headers cannot be encoded as an AMQP table: {exc}"
    return None


def to_message(row: OutboxRow, *, max_bytes: int) -> Message | str:
    """A message for ``row``, or the reason it can never be published (it is dead-lettered)."""
    body = row.payload.encode() if row.payload is not None else bytes(row.payload_bytes or b"")
    content_type = row.content_type or (
        "application/json" if row.payload is not None else "application/octet-stream")
    error = (
        _shortstr("exchange", row.exchange)
        or _shortstr("routing_key", row.routing_key)
        or _shortstr("message_id", row.message_id)
        or _shortstr("content_type", content_type)
        or _headers_error(row.headers)
    )
    if error is None and len(body) > max_bytes:
        error = f"payload of {len(body)} bytes exceeds OUTBOX_MAX_MESSAGE_BYTES={max_bytes}"
    if error is not None:
        return error
    properties = pika.BasicProperties(
        delivery_mode=2,
        message_id=row.message_id,
        content_type=content_type,
        headers=amqp_value(row.headers) or None,
        timestamp=int(row.created_at.timestamp()),
    )
    return Message(row.id, row.message_id, row.exchange, row.routing_key, body, properties)
