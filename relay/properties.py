"""A message's properties, encoded for the wire once, by struct, when their shape is the usual one.

pika encodes properties field by field and a header table value by value through a chain of
isinstance tests, in Python, for every message. Profiled on a relay publishing keyed events
(the two headers the relay adds), that Header.marshal took about a seventh of the relay's CPU
(the claim a fifth). Every message the relay builds sets content_type, delivery_mode,
message_id and timestamp; most carry no other header than a flat table of strings and integers
(the relay's own two, a producer's simple ones). For those, ``encoded`` builds the bytes pika
would write (tests/unit/test_properties.py compares them over many shapes) and the properties
hand them over as they are; for any other shape, or a value pika would refuse, it returns
pika's own properties, encoded by pika when published, as before.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping
from typing import Any

from pika.spec import BasicProperties

_FLAGS = (BasicProperties.FLAG_CONTENT_TYPE | BasicProperties.FLAG_DELIVERY_MODE
          | BasicProperties.FLAG_MESSAGE_ID | BasicProperties.FLAG_TIMESTAMP)
_FLAGS_PLAIN = struct.pack(">H", _FLAGS)
_FLAGS_HEADERS = struct.pack(">H", _FLAGS | BasicProperties.FLAG_HEADERS)
_INT32 = struct.Struct(">ci")
_INT64 = struct.Struct(">cq")
_LONG_STRING = struct.Struct(">cI")
_TABLE_SIZE = struct.Struct(">I")
_PERSISTENT = b"\x02"  # delivery mode
_TIMESTAMP = struct.Struct(">Q")


class EncodedProperties(BasicProperties):  # type: ignore[misc]  # pika has no type hints
    """pika's BasicProperties, with their wire form computed beforehand."""

    def __init__(self, wire: bytes, **fields: Any) -> None:
        super().__init__(**fields)
        self.wire = wire

    def encode(self) -> list[bytes]:
        return [self.wire]


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


def encoded(*, message_id: str, content_type: str, headers: Mapping[str, Any] | None,
            timestamp: int) -> BasicProperties:
    """Persistent message properties: encoded here when their shape allows, else pika's."""
    fields = {"delivery_mode": 2, "message_id": message_id, "content_type": content_type,
              "headers": headers or None, "timestamp": timestamp}
    try:
        parts = (_name(content_type), _table(headers) if headers else b"", _short(message_id))
    except UnicodeEncodeError:  # a lone surrogate: pika raises it when publishing, as before
        return BasicProperties(**fields)
    content, table, ident = parts
    if content is None or table is None or ident is None or not 0 <= timestamp < 1 << 64:
        return BasicProperties(**fields)
    flags = _FLAGS_HEADERS if headers else _FLAGS_PLAIN
    wire = b"".join((flags, content, table, _PERSISTENT, ident, _TIMESTAMP.pack(timestamp)))
    return EncodedProperties(wire, **fields)
