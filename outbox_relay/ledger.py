"""The broker-side ledger's records: their format, their signature, what one proves.

The ledger is a RabbitMQ stream with one record per fully confirmed batch. The relay appends a
batch record after every confirm of a batch is in and before COMMIT PREPARED. The resolver
reads it from a timestamp (outbox_relay.resolver.ledger); since a stream consumer is never told
it has reached the end, the resolver first appends a marker of its own and reads until that
marker comes back: every record published before the marker has then been seen. No driver here.

**Trust.** Anyone who may write to the stream's exchange (or, with older relays, to the default
exchange) can append to it, so a record is evidence only if a relay wrote it. Every record
carries an HMAC-SHA256 of its fields under the ledger key, a random secret kept in PostgreSQL
(``<table>_ledger_key``) that only the relays' role can read: the role that can finish prepared
transactions anyway. A batch record also names the prepared transaction's xid and database, and
the resolver checks both against ``pg_prepared_xacts``: a genuine record of an earlier
transaction that had the same gid proves nothing about this one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

VERSION = 1


def _mac(key: bytes, fields: list[Any]) -> str:
    """HMAC-SHA256 over the canonical JSON of ``fields`` (a list: no key order to agree on)."""
    text = json.dumps(["outbox-ledger", VERSION, *fields], separators=(",", ":"), ensure_ascii=True)
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def batch_record(key: bytes, *, gid: str, xid: int, database: str, count: int,
                 relay: str) -> bytes:
    """The signed record of a batch whose messages the broker confirmed (step 4)."""
    mac = _mac(key, ["batch", gid, xid, database, count, relay])
    return json.dumps({"type": "batch", "v": VERSION, "gid": gid, "xid": xid,
                       "database": database, "count": count, "relay": relay,
                       "mac": mac}).encode()


def marker_record(key: bytes, marker: str) -> bytes:
    return json.dumps({"type": "marker", "v": VERSION, "marker": marker,
                       "mac": _mac(key, ["marker", marker])}).encode()


def new_marker() -> str:
    return f"marker-{uuid.uuid4()}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _authentic_batch(key: bytes, record: dict[str, Any]) -> bool:
    fields = [record.get(name) for name in ("gid", "xid", "database", "count", "relay")]
    gid, xid, database, count, relay = fields
    mac = record.get("mac")
    if not (isinstance(gid, str) and _is_int(xid) and isinstance(database, str)
            and _is_int(count) and isinstance(relay, str) and isinstance(mac, str)):
        return False
    return hmac.compare_digest(_mac(key, ["batch", *fields]), mac)


def authentic_marker(key: bytes, record: dict[str, Any]) -> bool:
    mac = record.get("mac")
    return isinstance(mac, str) and hmac.compare_digest(
        _mac(key, ["marker", record.get("marker")]), mac)


@dataclass(frozen=True)
class Expected:
    """What a record must say to decide an in-doubt batch: its prepared transaction's xid and
    database, as ``pg_prepared_xacts`` has them."""

    xid: int
    database: str


@dataclass(frozen=True)
class Rejected:
    """A record that names an in-doubt batch but proves nothing about it."""

    gid: str
    reason: str  # "unauthenticated" or "other_transaction"
    offset: Any  # the record's stream offset (or None), to report each record once
    detail: str


def check_batch(record: dict[str, Any], *, key: bytes, candidates: Mapping[str, Expected],
                offset: Any) -> int | Rejected | None:
    """What a ledger record says about the candidates: the message count of the batch it proves
    committed, a Rejected when it names a candidate but proves nothing, None when it names none."""
    gid = record.get("gid")
    if record.get("type") != "batch" or not isinstance(gid, str) or gid not in candidates:
        return None  # not about a batch we are deciding: not worth a signature check
    if not _authentic_batch(key, record):
        return Rejected(gid, "unauthenticated", offset, "no valid signature of the ledger key")
    expected = candidates[gid]
    if record["xid"] != expected.xid or record["database"] != expected.database:
        return Rejected(
            gid, "other_transaction", offset,
            f"written for xid {record['xid']} in database {record['database']!r}, the "
            f"prepared transaction is xid {expected.xid} in {expected.database!r}")
    count: int = record["count"]
    return count
