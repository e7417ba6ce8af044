"""The gid format ``<prefix>:<instance>:<sequence>`` and the instance lock keys derived from it."""

from __future__ import annotations

import pytest

from outbox_relay.gid import PREFIX_RE, Gid, lock_class, new_instance_id


def test_gid_text_has_prefix_zero_padded_hex_instance_and_sequence() -> None:
    assert str(Gid("outbox", 0xABC, 42)) == "outbox:00000abc:42"


def test_gid_round_trips_through_parse() -> None:
    gid = Gid("relay-eu_1", 0x7FFFFFFF, 9_223_372_036_854_775_807)

    assert Gid.parse(str(gid)) == gid


def test_parse_reads_the_instance_as_hex() -> None:
    parsed = Gid.parse("outbox:000000ff:3")

    assert parsed is not None
    assert (parsed.prefix, parsed.instance, parsed.sequence) == ("outbox", 255, 3)


@pytest.mark.parametrize("text", [
    "", "outbox", "outbox:00000abc", "outbox:0000abc:1", "outbox:000000abc:1",
    "outbox:00000ABC:1", "outbox:0000zzzz:1", "Outbox:00000abc:1", "1outbox:00000abc:1",
    "a" * 33 + ":00000abc:1", "outbox:00000abc:12345678901234567890", "outbox:00000abc:-1",
    "outbox:00000abc:1:2", " outbox:00000abc:1", "_pg_foreign_xact", "outbox:00000abc:",
    "outbox:00000abc:1\n", "outbox\n:00000abc:1",
])
def test_parse_returns_none_for_foreign_transactions(text: str) -> None:
    assert Gid.parse(text) is None


def test_longest_gid_fits_postgres_200_byte_limit() -> None:
    longest = str(Gid("a" * 32, 2**31 - 1, 2**63 - 1))

    assert Gid.parse(longest) is not None
    assert len(longest.encode()) < 200


@pytest.mark.parametrize("text", [
    "outbox:80000000:1", "outbox:ffffffff:1",  # an instance no int4 lock key holds
    "outbox:00000001:9223372036854775808", "outbox:00000001:9999999999999999999",  # 2^63 on
])
def test_parse_refuses_what_no_relay_makes(text: str) -> None:
    """Any role may PREPARE under any gid: an instance of 2^31 or more made the resolver call
    pg_try_advisory_lock(integer, bigint), which does not exist, on every scan (issue 32)."""
    assert Gid.parse(text) is None


def test_parse_takes_the_largest_gid_a_relay_makes() -> None:
    assert Gid.parse("outbox:7fffffff:9223372036854775807") == Gid("outbox", 2**31 - 1, 2**63 - 1)


@pytest.mark.parametrize(("prefix", "ok"), [
    ("a", True), ("a" * 32, True), ("a" * 33, False), ("out_box-2", True), ("Outbox", False),
    ("9lives", False), ("out:box", False), ("out'box", False), ("", False), ("outbox\n", False),
])
def test_prefix_pattern(prefix: str, ok: bool) -> None:
    assert (PREFIX_RE.match(prefix) is not None) is ok


def test_instance_ids_fit_a_postgres_int4_and_vary() -> None:
    ids = {new_instance_id() for _ in range(64)}

    assert all(0 <= i < 2**31 for i in ids)
    assert len(ids) > 60


def test_lock_class_is_stable_31_bit_and_per_prefix() -> None:
    assert lock_class("outbox") == lock_class("outbox")
    assert lock_class("outbox") != lock_class("outbox2")
    assert all(0 <= lock_class(p) < 2**31 for p in ("outbox", "a", "z" * 32))
