"""A claimed row to the AMQP message the relay publishes, or the reason it never can be.

Every column of a row is the producer's: ``to_message`` decodes a claimed row's raw columns one
row at a time, so no content of a row can fail a batch or stop the relay. It runs the rules of
outbox_relay.rules (the producer API's too); whatever cannot be decoded, encoded or published is
a reason, and the row goes to the dead-letter table with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pika.spec import BasicProperties

from outbox_relay import properties
from outbox_relay.model import Message, OutboxRow, TracedMessage, Unpublishable
from outbox_relay.rules import (
    DEFAULT_FRAME_MAX,
    EMPTY_HEADERS,
    HEADERS_TEXT_MEASURED_ABOVE,
    TRACEPARENT_HEADER,
    TRACESTATE_HEADER,
    amqp_value,
    decode_headers,
    default_content_type,
    encoding_problem,
    field_problem,
    headers_text_problem,
    message_headers,
    property_fields,
    relay_headers_problem,
    short_reason,
    trace_context_problem,
    without_trace_context,
)

# Every property pika's BasicProperties.__init__ sets, at its default (None).
_UNSET: dict[str, Any] = dict(vars(BasicProperties()))


class EncodedProperties(BasicProperties):  # type: ignore[misc]  # pika has no type hints
    """pika's BasicProperties, with their wire form computed beforehand
    (outbox_relay.properties, or pika's encoder once): pika writes these bytes as they are.

    The header table is kept in that form only, and decoded from it when read: a batch holds
    its messages' bytes, never their tables as Python objects, which take up to tens of times
    more (docs/reliability.md#memory).
    """

    def __init__(self, wire: bytes, fields: Mapping[str, Any]) -> None:
        # What BasicProperties.__init__ does (it only assigns its fourteen properties), as two
        # dict updates instead of a call with keyword arguments: one of these is built per
        # message, and every keyword passed through cost (measured: the user_id property
        # made it 1,300 instructions dearer).
        self.__dict__.update(_UNSET)
        self.__dict__.update(fields)
        self.wire = wire
        if self.headers is not None:
            del self.headers  # __getattr__ reads it back from the wire form

    def __getattr__(self, name: str) -> Any:
        """Only for ``headers``, when read: decoded from the wire form (tests, logs)."""
        if name != "headers":
            raise AttributeError(name)
        decoded = BasicProperties()
        decoded.decode(self.wire)
        return decoded.headers

    def encode(self) -> list[bytes]:
        return [self.wire]


def encoded(*, message_id: str, content_type: str, headers: Mapping[str, Any] | None,
            timestamp: int, user_id: str | None = None, message_type: str | None = None,
            correlation_id: str | None = None) -> BasicProperties:
    """Persistent message properties: encoded beforehand when their shape allows, else pika's."""
    fields = property_fields(message_id, content_type, headers, timestamp, user_id,
                             message_type, correlation_id)
    return _properties(fields, properties.wire(**fields))


def _properties(fields: Mapping[str, Any], wire: bytes | None) -> BasicProperties:
    return BasicProperties(**fields) if wire is None else EncodedProperties(wire, fields)


def to_message(row: OutboxRow, *, max_bytes: int, frame_max: int = DEFAULT_FRAME_MAX,
               ledger_stream: str | None = None,
               user_id: str | None = None) -> Message | Unpublishable:
    """A message for ``row``, or why it can never be published (it is dead-lettered).

    ``user_id``: the user of the relay's broker connection, set as the message's user_id
    property; RabbitMQ refuses any other, so a consumer can tell a relay's message (and its
    order headers) from another publisher's. A malformed trace context (header traceparent or
    tracestate) is left out of the message, which says so (a TracedMessage). Never
    raises for a row's content: a row is decoded and checked here, on its own.
    """
    traced = False
    try:
        flat = row.headers == EMPTY_HEADERS
        if flat:  # the column's default, most rows: nothing to decode, only the relay's headers
            headers: Any = {}
        else:
            # A long text is measured first, decoded only if its table can fit: a table that
            # cannot is never built (headers_text_problem; the length test inlined, most
            # headers are short).
            undecodable = (headers_text_problem(row.headers, frame_max)
                           if len(row.headers) >= HEADERS_TEXT_MEASURED_ABOVE else None)
            if undecodable is None:
                headers, undecodable = decode_headers(row.headers)
            if undecodable is not None:
                return Unpublishable(undecodable)
            forged = relay_headers_problem(headers)
            if forged is not None:
                return Unpublishable(forged.reason)
            # A malformed trace context is left out, never a reason to dead-letter a row.
            if type(headers) is dict and (TRACEPARENT_HEADER in headers
                                          or TRACESTATE_HEADER in headers):
                traced, bad_trace = True, trace_context_problem(headers)
                if bad_trace is not None:
                    headers = without_trace_context(headers, bad_trace)
        headers = message_headers(headers, row.ordering_key, row.id)
        content_type = row.content_type or default_content_type(row.is_json)
        found = field_problem(
            message_id=row.message_id, exchange=row.exchange, routing_key=row.routing_key,
            body_size=len(row.body), headers=headers, content_type=content_type,
            created_at=row.created_epoch, created_shown=repr(row.created_at),
            max_message_bytes=max_bytes, ledger_stream=ledger_stream, flat=flat,
            message_type=row.message_type, correlation_id=row.correlation_id)
        if found is None:
            fields = property_fields(row.message_id, content_type,
                                     headers if flat else amqp_value(headers), row.created_epoch,
                                     user_id, row.message_type, row.correlation_id)
            found, wire = encoding_problem(fields, body_size=len(row.body), frame_max=frame_max)
    except (RecursionError, ValueError, OverflowError, TypeError, MemoryError) as exc:
        return Unpublishable(f"row cannot be decoded: {type(exc).__name__}: {short_reason(exc)}")
    if found is not None:
        return Unpublishable(found.reason)
    if traced:
        return TracedMessage(row.id, row.message_id, row.exchange, row.routing_key, row.body,
                             _properties(fields, wire), row.ordering_key,
                             headers.get(TRACEPARENT_HEADER),
                             None if bad_trace is None else bad_trace.field)
    return Message(row.id, row.message_id, row.exchange, row.routing_key, row.body,
                   _properties(fields, wire), row.ordering_key)
