"""Reading and checking a ledger record never raises, whatever its bytes (issue 32, item 1).

A stream holds whatever any user of the vhost appends. Every record of
devenv.hostile.poisoned_records, and thousands of random mutations of a relay's record, are read
and checked without an exception, by the checks themselves (never by the last-resort handler),
and rejected with a reason; a relay's own record is still believed. Against real servers:
tests/integration/test_ledger_trust.py.
"""

from __future__ import annotations

import json
import random
import struct
from datetime import datetime

import pika.channel
import pika.data
import pika.frame
import pika.spec
import pytest

from devenv.hostile import FAR_TIMESTAMP, POISONED_REJECTED_AS, poisoned_records
from outbox_relay import ledger, pika_private
from outbox_relay.model import SessionRole
from tests.unit.fakes import LEDGER_KEY
from tests.unit.test_resolver import World

GID = "outbox:0000000a:1"
XID = 1001
CANDIDATES = {GID: ledger.Expected(XID, "app")}


def verdict(body: bytes, offset: int = 7) -> int | ledger.Rejected | None:
    record = ledger.read_record(body, offset=offset)
    if isinstance(record, ledger.Rejected):
        return record
    return ledger.check_batch(record, key=LEDGER_KEY, candidates=CANDIDATES, offset=offset)


def genuine(**fields: object) -> bytes:
    values: dict[str, object] = dict(gid=GID, xid=XID, database="app", count=3, relay="0000000a")
    values.update(fields)
    return ledger.batch_record(LEDGER_KEY, **values)  # type: ignore[arg-type]


def test_a_relays_record_is_believed() -> None:
    assert verdict(genuine()) == 3


@pytest.mark.parametrize("kind", sorted(POISONED_REJECTED_AS))
def test_every_poisoned_record_is_rejected_with_its_reason(kind: str) -> None:
    body, _headers = poisoned_records(GID, XID, "app")[kind]

    found = verdict(body)

    assert isinstance(found, ledger.Rejected), found
    assert found.reason == POISONED_REJECTED_AS[kind], found
    assert found.gid in (GID, None) and found.offset == 7
    assert "cannot be" not in found.detail, found.detail  # the checks, not the last resort
    assert found.detail.isprintable() and len(found.detail) < 200


def test_the_record_of_issue_32_no_longer_raises() -> None:
    """hmac.compare_digest raised TypeError on a non-ASCII str mac."""
    found = verdict(json.dumps({**json.loads(genuine()), "mac": "é" * 64}).encode())

    assert isinstance(found, ledger.Rejected) and found.reason == "unauthenticated"
    assert found.detail == "mac is a string of 64 characters, not 64 hex digits"


def test_a_relays_largest_record_is_far_under_the_bound() -> None:
    """A gid of 199 bytes, a database name of 63 non-ASCII characters (escaped: 6 bytes each)."""
    body = genuine(gid="a" * 32 + ":7fffffff:" + "9" * 19, database="é" * 63,
                   count=2**31 - 1, xid=2**32 - 1, relay="7fffffff")

    assert len(body) * 4 < ledger.MAX_RECORD_BYTES


def test_thousands_of_mutations_of_a_record_never_raise() -> None:
    rng = random.Random(32)
    base = genuine()
    for _ in range(5000):
        body = bytearray(base)
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(len(body) + 1)
            choice = rng.random()
            if choice < 0.4 and at < len(body):
                body[at] = rng.randrange(256)
            elif choice < 0.7:
                body[at:at] = rng.choice([b"[", b"{", b'"', b"\\u00e9", b"1e999", b"\xff",
                                          b"NaN", b"-", b"9" * 50, b"\\ud800", b"]", b"}"])
            else:
                del body[at:at + rng.randint(1, 20)]
        found = verdict(bytes(body))
        assert found is None or found == 3 or (
            isinstance(found, ledger.Rejected) and "cannot be checked" not in found.detail
            and found.reason in ledger.REJECTIONS), (bytes(body), found)


@pytest.mark.parametrize("value", [
    "é", ["a"], {"a": 1}, 1, None, True, "0" * 63, "A" * 64, "\ud800" * 64,
])
def test_a_marker_with_our_id_and_any_mac_is_rejected_never_raised(value: object) -> None:
    record = {"type": "marker", "v": 1, "marker": "marker-1", "mac": value}

    found = ledger.check_marker(record, key=LEDGER_KEY, marker="marker-1", offset=3)

    assert isinstance(found, ledger.Rejected) and found.reason == "unauthenticated"


def test_our_signed_marker_is_ours_and_anothers_is_not() -> None:
    ours = json.loads(ledger.marker_record(LEDGER_KEY, "marker-1"))

    assert ledger.check_marker(ours, key=LEDGER_KEY, marker="marker-1", offset=1) is True
    assert ledger.check_marker(ours, key=LEDGER_KEY, marker="marker-2", offset=1) is False


def test_a_resolver_reading_every_poisoned_record_decides_and_counts_each() -> None:
    world = World()
    xact = world.batch(0xA)
    for body, _headers in poisoned_records(xact.gid, xact.xid, xact.database).values():
        world.ledger.append(body)
    world.ledger.record(world.batch(0xB), count=4)  # a relay's record after them all
    resolver = world.resolver(role=SessionRole("relay", superuser=False))

    outcomes = resolver.resolve_once()

    assert outcomes == {xact.gid: "rolled_back", "outbox:0000000b:1": "committed"}
    counted = {reason: resolver.metrics.registry.get_sample_value(
        "outbox_resolver_ledger_records_rejected_total", {"reason": reason})
        for reason in ledger.REJECTIONS}
    expected = {reason: float(list(POISONED_REJECTED_AS.values()).count(reason))
                for reason in ledger.REJECTIONS}
    assert counted == expected


# -- header values pika cannot represent ------------------------------------------------------


def table(*values: bytes) -> bytes:
    """An AMQP field table {"a0": values[0], ...} of encoded values."""
    entries = b"".join(bytes([2]) + f"a{n}".encode() + value for n, value in enumerate(values))
    return struct.pack(">I", len(entries)) + entries


def test_header_values_pika_cannot_represent_decode_as_numbers() -> None:
    """A timestamp past 9999 made pika raise while decoding the frame: the connection of every
    ledger read was lost (issue 32)."""
    pika_private.tolerate_out_of_range_fields()
    nan = b"d" + struct.pack(">d", float("nan"))
    nested = b"F" + table(bytes(FAR_TIMESTAMP))
    array = b"A" + struct.pack(">I", 9) + bytes(FAR_TIMESTAMP)
    in_range = b"T" + struct.pack(">Q", 1_700_000_000)

    decoded, _end = pika.data.decode_table(
        table(bytes(FAR_TIMESTAMP), nan, nested, array, in_range, b"S\0\0\0\2ok"), 0)

    assert decoded["a0"] == 2**40
    assert decoded["a1"] != decoded["a1"]  # NaN
    assert decoded["a2"] == {"a0": 2**40}
    assert decoded["a3"] == [2**40]
    assert isinstance(decoded["a4"], datetime)  # what pika decodes in range is unchanged
    assert decoded["a5"] == "ok"


# -- the key id -------------------------------------------------------------------------------

OTHER_KEY = b"o" * 32


def test_every_record_carries_the_id_of_its_key() -> None:
    kid = ledger.key_id(LEDGER_KEY)

    assert len(kid) == 16 and int(kid, 16) >= 0 and kid != ledger.key_id(OTHER_KEY)
    assert json.loads(genuine())["kid"] == kid
    assert json.loads(ledger.marker_record(LEDGER_KEY, "marker-1"))["kid"] == kid


def test_a_record_of_another_key_reads_as_other_key_not_as_a_forgery() -> None:
    found = verdict(ledger.batch_record(OTHER_KEY, gid=GID, xid=XID, database="app", count=3,
                                        relay="0000000a"))

    assert isinstance(found, ledger.Rejected) and found.reason == "other_key"
    assert ledger.key_id(OTHER_KEY) in found.detail and ledger.key_id(LEDGER_KEY) in found.detail


def test_the_key_id_decides_nothing() -> None:
    """It is not signed: a forger copying our id is a forgery; a relay's record whose id was
    changed is still proven by its signature."""
    forged = {**json.loads(ledger.batch_record(OTHER_KEY, gid=GID, xid=XID, database="app",
                                               count=3, relay="x")),
              "kid": ledger.key_id(LEDGER_KEY)}
    relabelled = {**json.loads(genuine()), "kid": ledger.key_id(OTHER_KEY)}

    found = verdict(json.dumps(forged).encode())
    assert isinstance(found, ledger.Rejected) and found.reason == "unauthenticated"
    assert verdict(json.dumps(relabelled).encode()) == 3


def test_a_record_of_the_previous_version_without_key_id_is_checked_as_before() -> None:
    def previous(key: bytes) -> bytes:  # outbox_relay/ledger.py's batch_record at 7f35abe
        mac = ledger._mac(key, ["batch", GID, XID, "app", 3, "0000000a"])
        return json.dumps({"type": "batch", "v": 1, "gid": GID, "xid": XID, "database": "app",
                           "count": 3, "relay": "0000000a", "mac": mac}).encode()

    assert verdict(previous(LEDGER_KEY)) == 3
    found = verdict(previous(OTHER_KEY))
    assert isinstance(found, ledger.Rejected) and found.reason == "unauthenticated"


def test_a_previous_resolver_still_believes_a_record_with_a_key_id() -> None:
    """The id is outside the signature: resolvers of 7f35abe read new relays' records (a
    rolling upgrade decides batches in doubt as before)."""
    record = json.loads(genuine())
    fields = [record[name] for name in ("gid", "xid", "database", "count", "relay")]

    assert ledger._mac(LEDGER_KEY, ["batch", *fields]) == record["mac"]


@pytest.mark.parametrize("kid", [None, 5, ["a"], "g" * 16, "0" * 15, "é" * 16, "0" * 64])
def test_a_key_id_that_cannot_be_one_is_malformed(kid: object) -> None:
    found = verdict(json.dumps({**json.loads(genuine()), "kid": kid}).encode())

    assert isinstance(found, ledger.Rejected) and found.reason == "malformed"


# -- bodies pika keeps -----------------------------------------------------------------------


class FakeChannel:
    def __init__(self) -> None:
        self._content_assembler = pika.channel.ContentFrameAssembler()


def message(size: int, *, frame: int = 1000) -> list[object]:
    """The frames of one delivery of a ``size``-byte body, in ``frame``-byte body frames."""
    body = bytes(size)
    return [pika.frame.Method(1, pika.spec.Basic.Deliver("tag", 1)),
            pika.frame.Header(1, size, pika.spec.BasicProperties()),
            *[pika.frame.Body(1, body[at:at + frame]) for at in range(0, size, frame)]]


def assemble(channel: FakeChannel, frames: list[object]) -> list[object]:
    return [out for f in frames if (out := channel._content_assembler.process(f))]


def test_a_body_over_the_bound_is_dropped_frame_by_frame() -> None:
    channel = FakeChannel()
    pika_private.bound_bodies(channel, 4096)

    (small,) = assemble(channel, message(4096))
    (big,) = assemble(channel, message(1_000_000))
    (after,) = assemble(channel, message(10))

    assert small[2] == bytes(4096) and not isinstance(small[2], pika_private.DroppedBody)
    assert isinstance(big[2], pika_private.DroppedBody) and big[2] == b""
    assert big[2].size == 1_000_000
    assert channel._content_assembler._body_fragments == []  # nothing kept along the way
    assert after[2] == bytes(10)


def test_the_bound_takes_over_a_message_begun_before_it() -> None:
    """Frames of a channel closed just before, under the same number, can reach the new one
    while it opens: the bounded assembler finishes what pika's own had begun."""
    channel = FakeChannel()
    frames = message(3000)
    assert assemble(channel, frames[:3]) == []
    pika_private.bound_bodies(channel, 4096)

    (done,) = assemble(channel, frames[3:])

    assert done[2] == bytes(3000)


def test_a_dropped_body_reads_as_oversized() -> None:
    dropped = pika_private.DroppedBody()
    dropped.size = 10_000

    found = ledger.read_record(dropped, offset=3, size=dropped.size)

    assert isinstance(found, ledger.Rejected) and found.reason == "oversized"
