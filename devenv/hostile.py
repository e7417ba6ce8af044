"""Hostile neighbours of the relays, written once for the tests and the chaos runs.

What a party that shares the servers can do without any secret of the relays:

- a broker user who may publish to the default exchange appends anything to the ledger stream:
  ``poisoned_records`` (records no check may raise on) and ``append_to_ledger``;
- any PostgreSQL role may ``PREPARE TRANSACTION`` under any gid, ours included, once
  ``max_prepared_transactions`` > 0: ``foreign_gids`` and ``prepare_foreign``; and a role that
  cannot read the ledger key may prepare a gid a relay could have made (``relay_shaped_gid``).

The resolver must leave each alone, count it and say so once, and go on deciding the relays'
batches (docs/reliability.md, "Hostile and broken rows" and "The ledger's trust model").
tests/integration/test_ledger_trust.py and tests/integration/test_foreign_prepared.py use these
against real servers; the chaos runs mix them into their traffic (devenv/chaos_neighbours.py).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import pika
import pika.data
import psycopg
from psycopg import sql

__all__ = ["POISONED_REJECTED_AS", "RawField", "append_to_ledger", "foreign_gids",
           "poisoned_records", "prepare_foreign", "relay_shaped_gid"]


class RawField(bytes):
    """An AMQP field-table value given as its encoded bytes (type octet and value), for what
    pika refuses to encode: a timestamp past the year 9999, which pika's decoder then fails on
    (``datetime.fromtimestamp``) in whoever reads the message."""


def _encode_value(pieces: list[bytes], value: Any) -> int:
    if isinstance(value, RawField):
        pieces.append(bytes(value))
        return len(value)
    return int(_PIKA_ENCODE_VALUE(pieces, value))


_PIKA_ENCODE_VALUE = pika.data.encode_value
pika.data.encode_value = _encode_value  # devenv only: the programs never import this module

# A header value of type 'T' (timestamp) in the year 36812: RabbitMQ keeps it through the
# stream; pika's decoder raises ValueError on it, and the reader's connection is lost.
FAR_TIMESTAMP = RawField(b"T" + struct.pack(">Q", 2**40))


def poisoned_records(gid: str, xid: int, database: str = "outbox"
                     ) -> dict[str, tuple[bytes, dict[str, Any] | None]]:
    """{kind: (body, AMQP headers)}: ledger records naming the in-doubt batch ``gid`` (its real
    xid and database: pg_prepared_xacts is readable by every role) that no check may raise on,
    whatever their bytes. None of them is signed with the ledger key."""
    fields: dict[str, Any] = {"type": "batch", "v": 1, "gid": gid, "xid": xid,
                              "database": database, "count": 20, "relay": "00000001"}

    def record(**changes: Any) -> bytes:
        return json.dumps({**fields, "mac": "0" * 64, **changes}).encode()

    head = json.dumps({**fields, "mac": "0" * 64})[:-1]  # the record without its closing brace
    return {
        # hmac.compare_digest raises TypeError on a non-ASCII str (issue 32).
        "non_ascii_mac": (json.dumps({**fields, "mac": "é" * 64}, ensure_ascii=False).encode(),
                          None),
        "escaped_non_ascii_mac": (record(mac="\u00e9" * 64), None),
        "lone_surrogate_mac": (record(mac="\ud800" * 64), None),
        "mac_not_a_string": (record(mac=[1, 2]), None),
        "mac_of_another_length": (record(mac="0" * 63), None),
        "wrong_types_everywhere": (record(xid=str(xid), database=[database], count="20",
                                          relay=None, v="1"), None),
        "bool_for_ints": (record(xid=True, count=False), None),
        "nan_and_infinity": (f'{head}, "xid": NaN, "count": Infinity}}'.encode(), None),
        # Within a relay's record size bound (ledger.MAX_RECORD_BYTES), and over it.
        "number_of_3800_digits": (f'{head}, "xid": {"9" * 3800}}}'.encode(), None),
        "nested_1900_deep": (f'{head}, "pad": {"[" * 1900}{"]" * 1900}}}'.encode(), None),
        "number_of_10000_digits": (f'{head}, "xid": {"9" * 10_000}}}'.encode(), None),
        "float_of_10000_digits": (f'{head}, "count": 0.{"1" * 10_000}e99999}}'.encode(), None),
        "nested_100000_deep": (f'{head}, "pad": {"[" * 100_000}{"]" * 100_000}}}'.encode(),
                               None),
        "huge": (record(pad="x" * (4 << 20)), None),
        "gid_not_a_string": (record(gid=[gid]), None),
        "not_json": (b"\xff\xfe\x00 not json {", None),
        "not_utf8_in_a_string": (record(relay="X").replace(b'"X"', b'"\xff\xfe"'), None),
        "not_an_object": (json.dumps([gid, xid]).encode(), None),
        "empty": (b"", None),
        "timestamp_header_past_9999": (record(), {"at": FAR_TIMESTAMP}),
    }


# What the resolver rejects each of poisoned_records as (outbox_relay/ledger.py's reasons):
# unauthenticated without a mac that can be a signature, malformed when it cannot be read or
# its fields checked, oversized (not read) over MAX_RECORD_BYTES.
POISONED_REJECTED_AS = {
    "non_ascii_mac": "unauthenticated", "escaped_non_ascii_mac": "unauthenticated",
    "lone_surrogate_mac": "unauthenticated", "mac_not_a_string": "unauthenticated",
    "mac_of_another_length": "unauthenticated", "wrong_types_everywhere": "malformed",
    "bool_for_ints": "malformed", "nan_and_infinity": "malformed",
    "number_of_3800_digits": "malformed", "nested_1900_deep": "malformed",
    "number_of_10000_digits": "oversized", "float_of_10000_digits": "oversized",
    "nested_100000_deep": "oversized", "huge": "oversized", "gid_not_a_string": "malformed",
    "not_json": "malformed", "not_utf8_in_a_string": "malformed", "not_an_object": "malformed",
    "empty": "malformed", "timestamp_header_past_9999": "unauthenticated",
}


def append_to_ledger(amqp_url: str, stream: str, records: Mapping[str, tuple[bytes,
                     dict[str, Any] | None]] | list[tuple[bytes, dict[str, Any] | None]], *,
                     exchange: str = "") -> int:
    """Append ``records`` (bodies and headers) to the ledger stream as any user of the vhost
    can: through the default exchange unless told otherwise, each confirmed by the broker.
    ``amqp_url``: one URL, or a cluster's comma-separated URLs (the first node that answers).
    Returns how many were appended."""
    bodies = list(records.values()) if isinstance(records, Mapping) else list(records)
    conn = pika.BlockingConnection([pika.URLParameters(url) for url in amqp_url.split(",")])
    try:
        channel = conn.channel()
        channel.confirm_delivery()
        for body, headers in bodies:
            channel.basic_publish(exchange, stream, body,
                                  pika.BasicProperties(headers=headers, delivery_mode=2))
    finally:
        conn.close()
    return len(bodies)


def foreign_gids(prefix: str) -> dict[str, str]:
    """{kind: gid}: gids of our prefix that no relay makes. A relay's gid is
    ``<prefix>:<8 hex digits, below 2^31>:<sequence below 2^63>`` (outbox_relay/gid.py)."""
    head = f"{prefix}:"
    return {
        # pg_try_advisory_lock(integer, bigint) does not exist: the resolver crash-looped.
        "instance_over_2_31": f"{head}ffffffff:1",
        "instance_2_31": f"{head}80000000:1",
        "sequence_over_2_63": f"{head}00000001:{2**63}",
        "sequence_20_digits": f"{head}00000001:{2**64 - 1}",
        "199_bytes": head + "9" * (199 - len(head)),
        "non_ascii": f"{head}0000000é:1",
        "quote": f"{head}00000001:1'; SELECT 1; --",
        "newline": f"{head}00000001:1\n2026-01-01 resolver INFO a forged log line",
        "not_our_format": f"{head}not-a-relay-gid",
    }


def relay_shaped_gid(prefix: str, instance: int = 0xABC, sequence: int = 1) -> str:
    """A gid a relay could have made (``Gid.parse`` accepts it): foreign only by who prepares
    it, a role that cannot read the ledger key, as every relay's role can."""
    return f"{prefix}:{instance:08x}:{sequence}"


def prepare_foreign(db_url: str, gid: str, *, statement: str = "SELECT 1") -> None:
    """``BEGIN; <statement>; PREPARE TRANSACTION '<gid>'`` on a session of its own, as the
    role of ``db_url`` (any role may prepare once max_prepared_transactions > 0). The
    transaction stays prepared until someone finishes it."""
    with psycopg.connect(db_url) as conn:
        conn.execute(statement)
        conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
