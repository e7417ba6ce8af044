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

**Key id.** Every record a relay or resolver writes carries ``kid``, a short id of the key
that signed it (``key_id``: the first 8 bytes of HMAC(key, "outbox-ledger key-id"), which
tells nothing about the key). A record whose signature fails and whose key id is not ours reads
as "other_key" (a key replaced since, or a relay of another OUTBOX_TABLE, so of another key),
not as a forgery. The id is not signed, so it decides nothing: a forger may write any, which is
why the detail says "or a forgery"; what a record proves rests on its signature alone, and a
record without a key id (written by an earlier version) is checked as before.

**Any bytes.** A stream holds whatever any user of the vhost appends, so reading and checking a
record never raises, whatever its bytes (``hmac.compare_digest`` raises TypeError on a
non-ASCII str; a record of any size was parsed whole; issue 32): ``read_record`` and the checks
return a ``Rejected`` for what they cannot read or check, and the resolver counts it, logs it
once and reads on.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

VERSION = 1
# A relay's record is under 1 kB (a gid under 200 bytes, a database name under 64, a relay id
# of 8 and a mac of 64 characters); a bigger one is rejected unparsed, so no record costs more
# than this to decode, whatever it holds.
MAX_RECORD_BYTES = 4096
# What a record may hold: a mac is 64 lowercase hex digits (compared as ASCII text only); the
# numbers and names of a batch fit PostgreSQL's types.
_MAC = re.compile(r"[0-9a-f]{64}")
_KEY_ID = re.compile(r"[0-9a-f]{16}")
_INT_LIMIT = 1 << 63
_TEXT_LIMIT = 1024
# Why a record was rejected (outbox_resolver_ledger_records_rejected_total's reason label).
REJECTIONS = ("unauthenticated", "other_key", "other_transaction", "malformed", "oversized")


@functools.lru_cache(maxsize=8)
def key_id(key: bytes) -> str:
    """A short public id of ``key`` (16 hex digits), carried in every record as ``kid``."""
    return hmac.new(key, b"outbox-ledger key-id", hashlib.sha256).hexdigest()[:16]


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
                       "kid": key_id(key), "mac": mac}).encode()


def marker_record(key: bytes, marker: str) -> bytes:
    return json.dumps({"type": "marker", "v": VERSION, "marker": marker, "kid": key_id(key),
                       "mac": _mac(key, ["marker", marker])}).encode()


def new_marker() -> str:
    return f"marker-{uuid.uuid4()}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _INT_LIMIT


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= _TEXT_LIMIT


@dataclass(frozen=True)
class Expected:
    """What a record must say to decide an in-doubt batch: its prepared transaction's xid and
    database, as ``pg_prepared_xacts`` has them."""

    xid: int
    database: str


class Found(dict[str, int]):
    """{gid: message count} of the candidates a ledger read proved committed. ``span``: the
    first and last stream offsets of the read, which examined every record between them (None
    when the broker gave no offsets)."""

    span: tuple[int, int] | None = None


@dataclass(frozen=True)
class Rejected:
    """A record that cannot be read or checked, or that names an in-doubt batch but proves
    nothing about it."""

    gid: str | None  # the in-doubt batch it names; None when it names none that can be told
    reason: str  # one of REJECTIONS
    offset: int | None  # the record's stream offset, to report each record once
    detail: str


def read_record(body: bytes, *, offset: int | None,
                size: int | None = None) -> dict[str, Any] | Rejected:
    """The JSON object a ledger record holds, or why it cannot be read; never raises.

    ``size``: the body's size when the reader kept none of it (a body over MAX_RECORD_BYTES)."""
    size = len(body) if size is None else size
    if size > MAX_RECORD_BYTES:
        return Rejected(None, "oversized", offset,
                        f"{size} bytes, over the {MAX_RECORD_BYTES} a record may hold: not read")
    try:
        record = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        return Rejected(None, "malformed", offset, f"not JSON text ({type(exc).__name__})")
    except Exception as exc:  # a last resort: no bytes may stop a read (issue 32)
        return Rejected(None, "malformed", offset, f"cannot be read ({type(exc).__name__})")
    if not isinstance(record, dict):
        return Rejected(None, "malformed", offset,
                        f"a JSON {type(record).__name__}, not an object")
    return record


def _batch_problem(record: dict[str, Any]) -> str | None:
    """What keeps a batch record's fields from being checked, or None."""
    if record.get("v", VERSION) != VERSION or isinstance(record.get("v"), bool):
        return f"version {_show(record.get('v'))}, this resolver reads {VERSION}"
    for name, valid in (("xid", _is_int), ("database", _is_text), ("count", _is_int),
                        ("relay", _is_text)):
        if not valid(record.get(name)):
            return f"{name} is {_show(record.get(name))}"
    kid = record.get("kid")
    if "kid" in record and not (isinstance(kid, str) and _KEY_ID.fullmatch(kid)):
        return f"kid is {_show(kid)}, not 16 hex digits"
    return None


def _unproven(gid: str, record: dict[str, Any], key: bytes, offset: int | None,
              why: str) -> Rejected:
    """A record of ``gid`` without a valid signature of ``key``: of another key when it says
    so, else a forgery."""
    kid = record.get("kid")
    if isinstance(kid, str) and kid != key_id(key):
        return Rejected(gid, "other_key", offset,
                        f"signed with key id {kid}, the ledger key's is {key_id(key)}: a key "
                        "replaced since, a relay of another OUTBOX_TABLE, or a forgery")
    return Rejected(gid, "unauthenticated", offset, why)


def _signature(mac: Any) -> str | None:
    """A mac that can be a signature (64 hex digits, compared as ASCII text only: hmac raises
    TypeError on a non-ASCII str), or None."""
    return mac if isinstance(mac, str) and _MAC.fullmatch(mac) else None


def _show(value: Any) -> str:
    """A short, printable account of a value a forger chose."""
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return "an integer out of range"
    return f"a JSON {type(value).__name__}"


def check_batch(record: dict[str, Any], *, key: bytes, candidates: Mapping[str, Expected],
                offset: int | None) -> int | Rejected | None:
    """What a ledger record says about the candidates: the message count of the batch it proves
    committed, a Rejected when it names a candidate but proves nothing (or is a batch record
    that names nothing readable), None when it names none. Never raises."""
    try:
        return _check_batch(record, key=key, candidates=candidates, offset=offset)
    except Exception as exc:  # a last resort: no bytes may stop a read (issue 32)
        gid = record.get("gid") if isinstance(record, dict) else None
        return Rejected(gid if isinstance(gid, str) and gid in candidates else None,
                        "malformed", offset, f"cannot be checked ({type(exc).__name__})")


def _check_batch(record: dict[str, Any], *, key: bytes, candidates: Mapping[str, Expected],
                 offset: int | None) -> int | Rejected | None:
    if record.get("type") != "batch":
        return None  # a marker, or a kind of record this version does not know
    gid = record.get("gid")
    if not isinstance(gid, str):
        return Rejected(None, "malformed", offset, f"a batch record whose gid is {_show(gid)}")
    if gid not in candidates:
        return None  # not about a batch we are deciding: not worth a signature check
    problem = _batch_problem(record)
    if problem is not None:
        return Rejected(gid, "malformed", offset, problem)
    mac = _signature(record.get("mac"))
    if mac is None:
        return _unproven(gid, record, key, offset,
                         f"mac is {_show(record.get('mac'))}, not 64 hex digits")
    fields = [gid, record["xid"], record["database"], record["count"], record["relay"]]
    if not hmac.compare_digest(_mac(key, ["batch", *fields]), mac):
        return _unproven(gid, record, key, offset, "no valid signature of the ledger key")
    expected = candidates[gid]
    if record["xid"] != expected.xid or record["database"] != expected.database:
        return Rejected(
            gid, "other_transaction", offset,
            f"written for xid {record['xid']} in database {record['database']!r}, the "
            f"prepared transaction is xid {expected.xid} in {expected.database!r}")
    count: int = record["count"]
    return count


def check_marker(record: dict[str, Any], *, key: bytes, marker: str,
                 offset: int | None) -> bool | Rejected:
    """True for the resolver's own marker ``marker`` signed with ``key``; a Rejected for a
    record that carries our marker's id without that signature; False for any other record.
    Never raises."""
    if record.get("type") != "marker" or record.get("marker") != marker:
        return False
    mac = _signature(record.get("mac"))
    if mac is not None and hmac.compare_digest(_mac(key, ["marker", marker]), mac):
        return True
    return Rejected(marker, "unauthenticated", offset,
                    "a marker with our id and no valid signature")
