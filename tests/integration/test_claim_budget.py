"""The claim on a real PostgreSQL: its byte budget, rows too big to fetch moved to the
dead-letter table by the claim itself, and producer-written attempts (issue 10)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from outbox_relay.relay.store import OutboxStore
from outbox_relay.tables import Tables
from tests.conftest import Env

MB = 1 << 20


@pytest.fixture
def outbox(env: Env) -> Iterator[OutboxStore]:
    store = OutboxStore(env.db_url, env.table)
    store.connect(lock_class=1, instance=0x1B0B)
    yield store
    store.close()


def add(env: Env, count: int = 1, **columns: object) -> None:
    columns.setdefault("routing_key", "k")
    if "payload" not in columns and "payload_bytes" not in columns:
        columns["payload"] = Jsonb({"n": 1})
    names = sql.SQL(", ").join(sql.Identifier(c) for c in columns)
    values = sql.SQL(", ").join(sql.Placeholder() for _ in columns)
    with env.connect() as conn:
        for _ in range(count):
            conn.execute(sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
                Tables(env.table).outbox, names, values), list(columns.values()))


def test_a_batch_is_cut_at_its_byte_budget(env: Env, outbox: OutboxStore) -> None:
    add(env, 10, payload_bytes=b"x" * 1000)
    size = len(b"x" * 1000) + len("{}") + len("k") + 36  # body, headers, routing key, uuid

    rows = outbox.claim(10, 3 * size + size // 2)
    outbox.rollback()

    assert len(rows) == 3
    assert all(r.row_bytes == size for r in rows)


def test_a_batch_takes_one_row_whatever_its_size(env: Env, outbox: OutboxStore) -> None:
    add(env, 3, payload_bytes=b"x" * 5000)

    rows = outbox.claim(10, 10)
    outbox.rollback()

    assert len(rows) == 1 and len(rows[0].body) == 5000


def test_after_a_cut_the_next_claim_asks_for_about_twice_what_fit(
        env: Env, outbox: OutboxStore) -> None:
    add(env, 200, payload_bytes=b"x" * 1000)
    outbox.claim(100, 5000)  # 4 rows fit
    outbox.rollback()
    assert outbox._fitting == 8
    rows = outbox.claim(100, 1 << 30)  # the budget no longer binds: grows back by doubling
    outbox.rollback()
    assert len(rows) == 8 and outbox._fitting == 16


def test_a_smaller_claim_that_fits_keeps_what_the_budget_taught(
        env: Env, outbox: OutboxStore) -> None:
    add(env, 200, payload_bytes=b"x" * 1000)
    outbox.claim(100, 5000)  # 4 rows fit
    outbox.rollback()
    rows = outbox.claim(2, 1 << 30)  # a claim ahead asking for less: says nothing about 8
    outbox.rollback()
    assert len(rows) == 2 and outbox._fitting == 8


def test_rows_too_big_to_fetch_are_dead_lettered_by_the_claim(env: Env,
                                                              outbox: OutboxStore) -> None:
    add(env, payload=Jsonb({"before": 1}), message_id="small-1")
    add(env, payload_bytes=b"\x01" * (3 * MB), message_id="big-bytes")
    add(env, payload=Jsonb({"pad": "j" * (3 * MB)}), message_id="big-json")
    add(env, payload=Jsonb({}), headers=Jsonb({"h": "h" * (3 * MB)}), message_id="big-headers")
    add(env, payload=Jsonb({"after": 1}), message_id="small-2")

    rows = outbox.claim(10, 64 * MB, max_message_bytes=MB)
    outbox.prepare("t" + env.gid_prefix + ":00000001:1")
    outbox.finish("t" + env.gid_prefix + ":00000001:1", commit=True)

    kept = {r.message_id: r for r in rows if r.dead_reason is None}
    moved = {r.message_id: r for r in rows if r.dead_reason is not None}
    assert set(kept) == {"small-1", "small-2"}
    assert set(moved) == {"big-bytes", "big-json", "big-headers"}
    assert all(r.body == b"" and r.headers == "{}" for r in moved.values())  # never fetched
    assert moved["big-bytes"].dead_reason == (
        f"payload of {3 * MB} bytes exceeds OUTBOX_MAX_MESSAGE_BYTES={MB}")
    assert moved["big-json"].dead_reason.startswith("payload of ")  # type: ignore[union-attr]
    assert moved["big-headers"].dead_reason.startswith("row of ")  # type: ignore[union-attr]
    with env.connect() as conn:
        dead = {row[0]: row[1:] for row in conn.execute(sql.SQL(
            "SELECT message_id, octet_length(payload_bytes), octet_length(payload::text),"
            " octet_length(headers::text), attempts, outbox_id FROM {}").format(
            Tables(env.table).dead_letter)).fetchall()}
    assert dead["big-bytes"][0] == 3 * MB  # stored whole
    assert dead["big-json"][1] > 3 * MB
    assert dead["big-headers"][2] > 3 * MB
    assert {row[3] for row in dead.values()} == {1}


def test_producer_written_attempts_cannot_hide_a_row_or_break_the_claim(
        env: Env, outbox: OutboxStore) -> None:
    add(env, message_id="negative", attempts=-7)

    rows = outbox.claim(10, MB)
    outbox.rollback()

    assert [r.message_id for r in rows] == ["negative"]


def test_a_claim_ahead_takes_no_row_beyond_its_budget(env: Env, outbox: OutboxStore) -> None:
    # The batch claimed ahead shares the byte budget with the one in memory (issue 32).
    add(env, 3, payload_bytes=b"x" * 5000)

    none = outbox.claim(10, 100, one_row_at_least=False)
    outbox.rollback()
    two = outbox.claim(10, 2 * 5100, one_row_at_least=False)
    outbox.rollback()

    assert none == [] and len(two) == 2


def test_a_claim_ahead_takes_no_retried_row_beyond_its_budget(env: Env,
                                                             outbox: OutboxStore) -> None:
    add(env, payload_bytes=b"r" * 5000, attempts=1, message_id="retried")
    add(env, 2, payload_bytes=b"f" * 10)

    ahead = outbox.claim(10, 1000, one_row_at_least=False)
    outbox.rollback()
    alone = outbox.claim(10, 1000)
    outbox.rollback()

    # Fresh rows that fit instead (the retried one waits for a batch of its own).
    assert len(ahead) == 2 and "retried" not in {r.message_id for r in ahead}
    assert [r.message_id for r in alone] == ["retried"]


def test_a_claimed_row_goes_to_the_dead_letter_table_exactly_as_it_was(
        env: Env, outbox: OutboxStore) -> None:
    # The body goes back in binary, a JSON payload's text too (no copy of it made in Python).
    add(env, payload=Jsonb({"text": "ключ € 😀", "n": [1, 2.5, None]}), message_id="json",
        headers=Jsonb({"h": "v"}))
    add(env, payload_bytes=b"\x00\xff" * 100, message_id="bytes")

    rows = outbox.claim(10, MB)
    outbox.dead_letter_claimed([(row, "a reason") for row in rows])
    outbox.prepare("t" + env.gid_prefix + ":00000001:2")
    outbox.finish("t" + env.gid_prefix + ":00000001:2", commit=True)

    with env.connect() as conn:
        dead = {row[0]: row[1:] for row in conn.execute(sql.SQL(
            "SELECT message_id, payload, payload_bytes, headers, last_error FROM {}").format(
            Tables(env.table).dead_letter)).fetchall()}
    assert dead["json"] == ({"text": "ключ € 😀", "n": [1, 2.5, None]}, None, {"h": "v"},
                            "a reason")
    assert dead["bytes"] == (None, b"\x00\xff" * 100, {}, "a reason")
