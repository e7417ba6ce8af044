"""A message's properties encoded for the wire once, by struct, when their shape is the usual one.

pika encodes properties field by field and a header table value by value through a chain of
isinstance tests, in Python, for every message. Profiled on a relay publishing keyed events
(the two headers the relay adds), that Header.marshal took about a seventh of the relay's CPU
(the claim a fifth). Every message the relay builds sets content_type, delivery_mode,
message_id and timestamp, and user_id when it knows its connection's user (and type and
correlation_id when the row sets them); most carry no other header than a flat table of
strings and integers (the relay's own two, a producer's simple ones). For those, ``wire``
gives the bytes pika would write (tests/unit/test_properties.py compares them over many
shapes), which the relay hands to pika as they are (outbox_relay.relay.messages); for any
other shape, or a value pika would refuse, it gives None and pika encodes the properties
itself when they are published, as before.
No pika here: the producer API measures the usual header tables with it too.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping
from typing import Any

# The AMQP 0-9-1 Basic property flags this encodes (pika.spec.BasicProperties.FLAG_*, which
# tests/unit/test_properties.py checks them against).
FLAG_CONTENT_TYPE = 1 << 15
FLAG_HEADERS = 1 << 13
FLAG_DELIVERY_MODE = 1 << 12
FLAG_CORRELATION_ID = 1 << 10
FLAG_MESSAGE_ID = 1 << 7
FLAG_TIMESTAMP = 1 << 6
FLAG_TYPE = 1 << 5
FLAG_USER_ID = 1 << 4

_FLAGS = FLAG_CONTENT_TYPE | FLAG_DELIVERY_MODE | FLAG_MESSAGE_ID | FLAG_TIMESTAMP
# The two bytes of flags, by 2 * (headers present) + (user_id present).
_FLAG_BYTES = tuple(struct.pack(">H", _FLAGS | (FLAG_HEADERS if shape & 2 else 0)
                                | (FLAG_USER_ID if shape & 1 else 0)) for shape in range(4))
# The same, by 8 * (headers present) + 4 * (user_id present) + 2 * (correlation_id present)
# + (type present), for messages that set the type or correlation_id property.
_ID_FLAG_BYTES = tuple(struct.pack(">H", _FLAGS | (FLAG_HEADERS if shape & 8 else 0)
                                   | (FLAG_USER_ID if shape & 4 else 0)
                                   | (FLAG_CORRELATION_ID if shape & 2 else 0)
                                   | (FLAG_TYPE if shape & 1 else 0)) for shape in range(16))
_INT32 = struct.Struct(">ci")
_INT64 = struct.Struct(">cq")
_LONG_STRING = struct.Struct(">cI")
_TABLE_SIZE = struct.Struct(">I")
_PERSISTENT = 2  # delivery mode
_PERSISTENT_BYTE = bytes((_PERSISTENT,))
_TIMESTAMP = struct.Struct(">Q")


def _short(text: str) -> bytes | None:
    raw = text.encode()
    return bytes((len(raw),)) + raw if len(raw) <= 255 else None


@functools.lru_cache(maxsize=1024)
def _short_cached(text: str) -> bytes | None:
    return _short(text)


def _name(text: str) -> bytes | None:
    """_short of a string that repeats from message to message (a header name, a content type):
    cached, up to a bounded number of short ones (a producer may send a new name every row)."""
    return _short_cached(text) if len(text) <= 255 else None


# _short of the user ids a process sets (a relay: its connection's user, on every message),
# looked up in wire() without a call; a few at most (cleared past 16).
_USERS: dict[str, bytes | None] = {}


def _user(text: str) -> bytes | None:
    if len(_USERS) >= 16:
        _USERS.clear()
    found = _USERS[text] = _short(text)
    return found


def _table(headers: Mapping[str, Any]) -> bytes | None:
    """A flat table of str and int values as pika encodes it, or None for anything else."""
    pieces = []
    for name, value in headers.items():
        encoded_name = _name(name) if type(name) is str else None
        if encoded_name is None:
            return None
        pieces.append(encoded_name)
        if type(value) is str:
            raw = value.encode()
            pieces.append(_LONG_STRING.pack(b"S", len(raw)))
            pieces.append(raw)
        elif type(value) is int and -(1 << 31) <= value < 1 << 31:
            pieces.append(_INT32.pack(b"I", value))
        elif type(value) is int and -(1 << 63) <= value < 1 << 63:
            pieces.append(_INT64.pack(b"l", value))
        else:
            return None
    table = b"".join(pieces)
    return _TABLE_SIZE.pack(len(table)) + table


def wire(*, delivery_mode: int, message_id: str, content_type: str,
         headers: Mapping[str, Any] | None, timestamp: int,
         user_id: str | None = None, type: str | None = None,  # pika's name (shadows the builtin here only)
         correlation_id: str | None = None) -> bytes | None:
    """The property bytes pika writes for these fields, or None when this does not encode them
    (a header table of another shape, a text over 255 bytes or not encodable, a timestamp out
    of range, a transient message): pika's encoder then decides. The properties go in the
    order of their flag bits: content type, headers, delivery mode, correlation id, message
    id, timestamp, type, user id."""
    if delivery_mode != _PERSISTENT:
        return None
    if type is not None or correlation_id is not None:
        return _wire_with_ids(message_id, content_type, headers, timestamp, user_id, type,
                              correlation_id)
    try:
        parts = (_name(content_type), _table(headers) if headers else b"", _short(message_id),
                 b"" if user_id is None else _USERS.get(user_id) or _user(user_id))
    except UnicodeEncodeError:  # a lone surrogate: pika raises it when publishing, as before
        return None
    content, table, ident, user = parts
    if content is None or table is None or ident is None or user is None \
            or not 0 <= timestamp < 1 << 64:
        return None
    flags = _FLAG_BYTES[(2 if headers else 0) + (user_id is not None)]
    return b"".join((flags, content, table, _PERSISTENT_BYTE, ident, _TIMESTAMP.pack(timestamp),
                     user))


def _wire_with_ids(message_id: str, content_type: str, headers: Mapping[str, Any] | None,
                   timestamp: int, user_id: str | None, message_type: str | None,
                   correlation_id: str | None) -> bytes | None:
    """wire() of a message that sets the type or correlation_id property (a row's own: the
    correlation id is new in every message, the type is cached as a content type is)."""
    try:
        parts = (_name(content_type), _table(headers) if headers else b"", _short(message_id),
                 b"" if user_id is None else _USERS.get(user_id) or _user(user_id),
                 b"" if correlation_id is None else _short(correlation_id),
                 b"" if message_type is None else _name(message_type))
    except UnicodeEncodeError:
        return None
    content, table, ident, user, correlation, kind = parts
    if content is None or table is None or ident is None or user is None \
            or correlation is None or kind is None or not 0 <= timestamp < 1 << 64:
        return None
    flags = _ID_FLAG_BYTES[(8 if headers else 0) + (4 if user_id is not None else 0)
                           + (2 if correlation_id is not None else 0)
                           + (message_type is not None)]
    return b"".join((flags, content, table, _PERSISTENT_BYTE, correlation, ident,
                     _TIMESTAMP.pack(timestamp), kind, user))
