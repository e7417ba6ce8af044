"""The claim's low-water mark (relay/marks.py): each claim walks the primary key from the mark,
not from its start, and no row that appears below the mark is lost or delayed for good (issue
36). Each case against real PostgreSQL: a late producer commit, a batch rolled back (another
relay's, our own, a claim abandoned), a delayed row whose time came, a key freed (its head
published by another relay, its head's retry published, its dead letter requeued); and a
snapshot held elsewhere, which must not hold the mark back."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from outbox_relay.postgres import outbox_stats
from outbox_relay.relay import dead_letter
from outbox_relay.relay.marks import MARK_READ_ROWS, ClaimMarks
from outbox_relay.relay.store import OutboxStore
from outbox_relay.tables import Tables
from tests.conftest import Env

pytestmark = pytest.mark.core  # run on every tested PostgreSQL (CONTRIBUTING.md)

NEVER = 3600.0  # a full-look interval no test reaches: what is found, the mark found
SHORT = 0.3  # a full-look interval for the cases only a full look finds
_gids = itertools.count()


def make_store(env: Env, instance: int, interval: float, read_rows: int = 0) -> OutboxStore:
    """A store whose claims (by default) every one read where the marks move: the cases below
    follow the marks claim by claim."""
    store = OutboxStore(env.db_url, env.table)
    store.marks = ClaimMarks(interval=interval, read_rows=read_rows)
    store.connect(lock_class=36, instance=instance)
    return store


@pytest.fixture
def stores(env: Env) -> Iterator[Callable[[float], OutboxStore]]:
    made: list[OutboxStore] = []

    def make(interval: float) -> OutboxStore:
        made.append(make_store(env, 0x3600 + len(made), interval))
        return made[-1]

    yield make
    for store in made:
        store.close()


def add(conn: psycopg.Connection[Any], env: Env, name: str, *, key: str | None = None,
        due_in: float = 0.0, attempts: int = 0) -> int:
    """One row; returns its id."""
    row = conn.execute(sql.SQL(
        "INSERT INTO {} (message_id, routing_key, ordering_key, payload, available_at, attempts) "
        "VALUES (%s, 'k', %s, %s, now() + make_interval(secs => %s), %s) RETURNING id").format(
        Tables(env.table).outbox), (name, key, Jsonb({}), due_in, attempts)).fetchone()
    assert row is not None
    return int(row[0])


def claim(store: OutboxStore, env: Env, *, commit: bool = True) -> list[str]:
    """One batch: claim, prepare, commit (or roll back). The message ids claimed."""
    rows = store.claim(100, 1 << 30)
    if not rows:
        store.rollback()
        return []
    gid = f"{env.gid_prefix}-marks-{next(_gids)}"
    store.prepare(gid)
    store.finish(gid, commit=commit)
    return [r.message_id for r in rows]


def claim_until(store: OutboxStore, env: Env, wanted: set[str], seconds: float) -> float:
    """Claim batches until every one of ``wanted`` was claimed; the seconds it took."""
    started = time.monotonic()
    seen: set[str] = set()
    while not wanted <= seen:
        assert time.monotonic() - started < seconds, f"{wanted - seen} not claimed"
        seen.update(claim(store, env))
        time.sleep(0.02)
    return time.monotonic() - started


def test_a_late_producer_commit_holds_the_mark_until_it_ends(
        env: Env, stores: Callable[[float], OutboxStore]) -> None:
    relay = stores(NEVER)
    with env.connect() as conn, env.connect() as producer:
        assert claim(relay, env) == []  # the first claim: the look from the start
        producer.execute("BEGIN")
        late = add(producer, env, "late")  # its id is taken; its commit comes later
        add(conn, env, "early")
        assert claim(relay, env) == ["early"]
        add(conn, env, "next")
        assert claim(relay, env) == ["next"]
        assert relay.marks.mark < late  # the open INSERT holds the mark below its id
        producer.commit()
        assert claim(relay, env) == ["late"]  # found by the walk from the mark, not a full look
        assert relay.marks.full_looks == 1
        add(conn, env, "last")
        assert claim(relay, env) == ["last"]
        assert claim(relay, env) == []
        assert relay.marks.mark >= late  # and it moves on once the writer ended


def test_claims_that_do_not_read_the_marks_lose_no_late_commit(env: Env) -> None:
    """At the default cadence most small claims skip where the marks move (relay/marks.py,
    MARK_READ_ROWS): they move nothing, so a late commit below the rows they take is found
    by the walk from the mark all the same, and the mark moves past it only after a read."""
    relay = make_store(env, 0x36FF, NEVER, read_rows=MARK_READ_ROWS)
    try:
        with env.connect() as conn, env.connect() as producer:
            assert claim(relay, env) == []  # the first claim reads
            producer.execute("BEGIN")
            late = add(producer, env, "late")
            for n in range(MARK_READ_ROWS // 10 - 1):  # fewer rows than a read needs
                for i in range(10):
                    add(conn, env, f"r{n}-{i}")
                assert len(claim(relay, env)) == 10
            assert relay.marks.mark < late  # nothing read since the first claim
            producer.commit()
            assert claim(relay, env) == ["late"]
            for n in range(3):  # past MARK_READ_ROWS: a read, and the mark moves on
                for i in range(10):
                    add(conn, env, f"s{n}-{i}")
                assert len(claim(relay, env)) == 10
            assert relay.marks.mark >= late and relay.marks.full_looks == 1
    finally:
        relay.close()


def test_a_snapshot_held_elsewhere_does_not_hold_the_mark_back(
        env: Env, stores: Callable[[float], OutboxStore]) -> None:
    relay = stores(NEVER)
    with env.connect() as conn, env.connect() as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute(sql.SQL("SELECT count(*) FROM {}").format(Tables(env.table).outbox))
        ids = [add(conn, env, f"e{n}") for n in range(5)]
        assert len(claim(relay, env)) == 5
        assert claim(relay, env) == []
        assert relay.marks.mark >= ids[-1]
        holder.rollback()


def test_another_relays_rolled_back_batch_is_claimed_again(
        env: Env, stores: Callable[[float], OutboxStore]) -> None:
    relay, other = stores(NEVER), stores(NEVER)
    with env.connect() as conn:
        assert claim(relay, env) == []
        held = [add(conn, env, f"held{n}") for n in range(3)]
        assert sorted(r.message_id for r in other.claim(3, 1 << 30)) == ["held0", "held1",
                                                                         "held2"]
        gid = f"{env.gid_prefix}-marks-other"
        other.prepare(gid)  # in flight (or in doubt): the rows stay, locked
        add(conn, env, "free")
        assert claim(relay, env) == ["free"]
        assert claim(relay, env) == []
        assert relay.marks.mark < held[0]  # the mark stays below rows someone holds
        other.finish(gid, commit=False)
        assert sorted(claim(relay, env)) == ["held0", "held1", "held2"]
        assert relay.marks.full_looks == 1


def test_our_rolled_back_batch_and_abandoned_claim_are_claimed_again(
        env: Env, stores: Callable[[float], OutboxStore]) -> None:
    relay = stores(NEVER)
    with env.connect() as conn:
        assert claim(relay, env) == []
        for n in range(3):
            add(conn, env, f"r{n}")
        assert len(claim(relay, env, commit=False)) == 3  # ROLLBACK PREPARED
        assert sorted(claim(relay, env)) == ["r0", "r1", "r2"]
        add(conn, env, "a")
        assert [r.message_id for r in relay.claim(10, 1 << 30)] == ["a"]
        relay.rollback()  # abandoned before its PREPARE
        assert claim(relay, env) == ["a"]
        assert relay.marks.full_looks == 1


def test_a_delayed_row_is_claimed_once_due(
        env: Env, stores: Callable[[float], OutboxStore]) -> None:
    """Without an ordering key it is parked: below the floor too (the looks from the floor
    do not walk from it), until the first look after its time."""
    relay = stores(SHORT)
    with env.connect() as conn:
        inserted = time.monotonic()
        soon = add(conn, env, "soon", due_in=1.0)  # due within 2 s: not parked
        delayed = add(conn, env, "delayed", due_in=5.0)
        add(conn, env, "now")
        assert claim(relay, env) == ["now"]
        assert relay.marks.mark >= delayed  # stepped over: below the mark now
        assert relay.marks.floor == soon - 1  # the floor stays below the first
        claim_until(relay, env, {"soon"}, seconds=5.0)
        assert time.monotonic() - inserted < 1.0 + SHORT + 0.5  # found by the next full look
        time.sleep(SHORT)
        add(conn, env, "next")  # a look that takes nothing moves nothing
        assert claim(relay, env) == ["next"]
        assert relay.marks.floor >= delayed  # past the parked one
        claim_until(relay, env, {"delayed"}, seconds=8.0)
        assert time.monotonic() - inserted < 5.0 + SHORT + 0.5  # below the floor then


def test_a_delayed_keyed_row_keeps_the_floor(
        env: Env, stores: Callable[[float], OutboxStore]) -> None:
    """The head reads of its key start at the floor: they must see it."""
    relay = stores(SHORT)
    with env.connect() as conn:
        delayed = add(conn, env, "k1", key="k", due_in=1.0)
        second = add(conn, env, "k2", key="k")
        add(conn, env, "now")
        assert claim(relay, env) == ["now"]
        assert relay.marks.mark >= second and relay.marks.floor < delayed
        time.sleep(SHORT)
        assert claim(relay, env) == []  # k2 waits for its head, which is not due
        claim_until(relay, env, {"k1", "k2"}, seconds=5.0)


def test_a_keyed_row_due_later_holds_its_key_and_goes_first_in_it_once_due(
        env: Env, stores: Callable[[float], OutboxStore]) -> None:
    """Due over PARK_HORIZON from now, it parks its key: held (its head reads start below
    it), the floor passes the key's rows. The first look that finds it due within the
    horizon lets the key go and looks from below it; its rows then go in order."""
    relay = stores(SHORT)
    with env.connect() as conn:
        inserted = time.monotonic()
        delayed = add(conn, env, "k1", key="k", due_in=3.0)
        second = add(conn, env, "k2", key="k")
        add(conn, env, "now")
        assert claim(relay, env) == ["now"]
        assert relay.marks.held["k"] < delayed and relay.marks.floor >= second
        add(conn, env, "k3", key="k")  # above the floor: waits too
        assert claim(relay, env) == []
        claimed_in_order(relay, env, ["k1", "k2", "k3"], seconds=6.0)
        assert 3.0 <= time.monotonic() - inserted < 3.0 + SHORT + 0.5
        assert relay.marks.held == {}


def test_a_keyless_retry_below_the_floor_is_claimed_when_due(
        env: Env, stores: Callable[[float], OutboxStore]) -> None:
    """A retry is claimed by its available_at (outbox_retry_idx), not from the mark."""
    relay = stores(SHORT)
    with env.connect() as conn:
        retry = add(conn, env, "retry", attempts=1, due_in=1.0)
        add(conn, env, "now")
        assert claim(relay, env) == ["now"]
        assert relay.marks.floor >= retry
        took = claim_until(relay, env, {"retry"}, seconds=5.0)
        assert took < 1.0 + 0.5


def test_a_parked_row_made_due_is_seen_by_the_stats_full_pass(
        env: Env, stores: Callable[[float], OutboxStore]) -> None:
    """A producer's UPDATE brings a row due tomorrow to now, or gives it a key: no look from
    the floor passes it again, but the stats passes' full pass counts it in lowest_unparked,
    or names its key as parked, and the relay lowers the floor below it (worker.py,
    _stats_pass; ClaimMarks.check_floor)."""
    relay = stores(SHORT)
    tables = Tables(env.table)
    with env.connect() as conn:
        tomorrow = add(conn, env, "tomorrow", due_in=86400.0)
        keyed_later = add(conn, env, "keyed-later", due_in=86400.0)
        add(conn, env, "retry", attempts=1, due_in=86400.0)
        add(conn, env, "now")
        assert claim(relay, env) == ["now"]
        time.sleep(SHORT)
        assert claim(relay, env) == []
        assert relay.marks.floor >= keyed_later + 1
        assert outbox_stats(conn, tables).lowest_unparked is None  # all three parked
        conn.execute(sql.SQL("UPDATE {} SET available_at = now() WHERE id = %s").format(
            tables.outbox), (tomorrow,))
        conn.execute(sql.SQL("UPDATE {} SET ordering_key = 'k' WHERE id = %s").format(
            tables.outbox), (keyed_later,))
        stats = outbox_stats(conn, tables)
        assert (stats.lowest, stats.lowest_unparked) == (tomorrow, tomorrow)
        time.sleep(SHORT)
        assert claim(relay, env) == []  # the looks from the floor do not see it
        relay.marks.check_floor(stats)
        assert claim(relay, env) == ["tomorrow"]
        # Keyed now and due tomorrow: its key's head is parked. The floor passed it with no
        # key held: the stats name the key, and the look from below they ask for holds it.
        stats = outbox_stats(conn, tables)
        assert stats.lowest_unparked is None and stats.parked_keys == {"k": keyed_later}
        relay.marks.check_floor(stats)
        assert claim(relay, env) == []
        assert "k" in relay.marks.held
        time.sleep(SHORT)
        add(conn, env, "other")  # a look that takes nothing moves nothing
        assert claim(relay, env) == ["other"]
        assert relay.marks.held["k"] < keyed_later <= relay.marks.floor
        relay.marks.check_floor(outbox_stats(conn, tables))
        assert relay.marks.start()[1] is False  # held now: nothing lowered
        add(conn, env, "k-next", key="k")
        assert claim(relay, env) == []  # behind its head, due tomorrow


def test_a_key_held_by_another_relays_batch_is_claimed_once_it_commits(
        env: Env, stores: Callable[[float], OutboxStore]) -> None:
    relay, other = stores(NEVER), stores(NEVER)
    with env.connect() as conn:
        assert claim(relay, env) == []
        add(conn, env, "k1", key="k")
        second = add(conn, env, "k2", key="k")
        assert [r.message_id for r in other.claim(1, 1 << 30)] == ["k1"]
        gid = f"{env.gid_prefix}-marks-key"
        other.prepare(gid)
        add(conn, env, "free")
        assert claim(relay, env) == ["free"]  # k2 waits for k1
        assert relay.marks.mark < second
        other.finish(gid, commit=True)
        assert claim(relay, env) == ["k2"]
        assert relay.marks.full_looks == 1


def test_a_key_held_by_its_heads_retry_is_claimed_after_it(
        env: Env, stores: Callable[[float], OutboxStore]) -> None:
    relay = stores(SHORT)
    with env.connect() as conn:
        add(conn, env, "k1", key="k", attempts=1, due_in=1.0)  # failed once, retried in 1 s
        second = add(conn, env, "k2", key="k")
        add(conn, env, "free")
        assert claim(relay, env) == ["free"]
        # Its head is parked: the key held (its head reads start below it), the floor past it.
        assert relay.marks.mark >= second and relay.marks.floor >= second
        assert relay.marks.held == {"k": 0}
        claimed_in_order(relay, env, ["k1", "k2"], seconds=5.0)
        assert relay.marks.held == {}


def claimed_in_order(store: OutboxStore, env: Env, wanted: list[str], seconds: float) -> float:
    """Claim batches until every one of ``wanted`` was claimed, in that order (a batch's rows
    in id order); the seconds it took."""
    started = time.monotonic()
    seen: list[str] = []
    while len([name for name in seen if name in wanted]) < len(wanted):
        assert time.monotonic() - started < seconds, f"{wanted} not claimed: {seen}"
        seen += claim(store, env)
        time.sleep(0.02)
    assert [name for name in seen if name in wanted] == wanted, seen
    return time.monotonic() - started


def dead_lettered_key(relay: OutboxStore, conn: psycopg.Connection[Any], env: Env,
                      key: str = "k") -> tuple[int, int]:
    """A key whose head is dead-lettered and whose second row waits behind it; a keyless row
    claimed, and a look from the floor after it. (head id, second id)"""
    head = add(conn, env, f"{key}1", key=key)
    assert relay.dead_letter_rows({head: "poison"}) == [head]
    second = add(conn, env, f"{key}2", key=key)
    add(conn, env, "free")
    assert claim(relay, env) == ["free"]
    assert relay.marks.mark >= second  # its key has a dead letter: stepped over
    time.sleep(SHORT)
    add(conn, env, "next")
    assert claim(relay, env) == ["next"]
    return head, second


def test_a_key_freed_by_a_requeued_dead_letter_is_claimed_in_order(
        env: Env, stores: Callable[[float], OutboxStore]) -> None:
    """The floor passes a dead-lettered key's rows (its key held: its head reads start below
    them); the requeued head comes back at its old id, below the floor, and goes first."""
    relay = stores(SHORT)
    tables = Tables(env.table)
    with env.connect() as conn:
        head, second = dead_lettered_key(relay, conn, env)
        assert relay.marks.floor >= second and relay.marks.held == {"k": head - 1}
        third = add(conn, env, "k3", key="k")  # above the floor: waits too
        assert claim(relay, env) == []
        assert relay.marks.floor < third
        looks = relay.marks.full_looks
        dead_letter.requeue(conn, tables, None)
        took = claimed_in_order(relay, env, ["k1", "k2", "k3"], seconds=5.0)
        assert took < 4 * SHORT + 0.5 and relay.marks.full_looks > looks
        assert relay.marks.held == {}


def test_a_key_freed_by_a_discarded_dead_letter_is_claimed(
        env: Env, stores: Callable[[float], OutboxStore]) -> None:
    relay = stores(SHORT)
    tables = Tables(env.table)
    with env.connect() as conn:
        _head, second = dead_lettered_key(relay, conn, env)
        assert relay.marks.floor >= second
        ids = [row[0] for row in conn.execute(sql.SQL("SELECT id FROM {}").format(
            tables.dead_letter))]
        assert dead_letter.discard(conn, tables, ids) == ids
        took = claimed_in_order(relay, env, ["k2"], seconds=5.0)
        assert took < 4 * SHORT + 0.5


def test_a_key_dead_lettered_again_while_held_keeps_its_order(
        env: Env, stores: Callable[[float], OutboxStore]) -> None:
    """Requeued, then its head fails again before any look saw the key free: still held."""
    relay, other = stores(SHORT), stores(NEVER)
    tables = Tables(env.table)
    with env.connect() as conn:
        head, second = dead_lettered_key(relay, conn, env)
        dead_letter.requeue(conn, tables, None)
        assert other.claim(100, 1 << 30)[0].message_id == "k1"  # the requeued head, first
        other.rollback()
        assert other.dead_letter_rows({head: "poison again"}) == [head]
        time.sleep(SHORT)
        add(conn, env, "after")
        assert claim(relay, env) == ["after"]  # k2 still waits behind its head's dead letter
        assert relay.marks.held == {"k": head - 1} and relay.marks.floor >= second


def test_a_dead_letter_given_another_key_goes_first_in_it_once_requeued(
        env: Env, stores: Callable[[float], OutboxStore]) -> None:
    """An operator fixes a dead letter's ordering key (sql/roles.sql lets them): requeued, it
    gets its old id back, below the floor, and goes before the newer rows of its new key."""
    relay = stores(SHORT)
    tables = Tables(env.table)
    with env.connect() as conn:
        head, second = dead_lettered_key(relay, conn, env)
        assert relay.dead_letter_rows({second: "poison too"}) == [second]  # k stays dead
        conn.execute(sql.SQL("UPDATE {} SET ordering_key = 'j' WHERE outbox_id = %s").format(
            tables.dead_letter), (head,))
        add(conn, env, "j2", key="j")
        time.sleep(SHORT)
        add(conn, env, "other")
        assert claim(relay, env) == ["other"]
        assert relay.marks.floor >= second and relay.marks.held["j"] < head
        row = conn.execute(sql.SQL("SELECT id FROM {} WHERE outbox_id = %s").format(
            tables.dead_letter), (head,)).fetchone()
        assert row is not None
        dead_letter.requeue(conn, tables, [row[0]])
        claimed_in_order(relay, env, ["k1", "j2"], seconds=5.0)


def test_more_dead_keys_than_held_keep_the_floor_below_them(
        env: Env, stores: Callable[[float], OutboxStore],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_HELD_KEYS dead letters with a key, the floor stays below the first (as it did
    for all before); the keys held so far are let go, and the floor goes below them."""
    relay = stores(SHORT)
    with env.connect() as conn:
        head, _second = dead_lettered_key(relay, conn, env)
        assert relay.marks.held == {"k": head - 1}
        monkeypatch.setattr("outbox_relay.relay.store.MAX_HELD_KEYS", 1)
        other = add(conn, env, "j1", key="j")
        assert relay.dead_letter_rows({other: "poison"}) == [other]
        time.sleep(SHORT)
        add(conn, env, "last")
        assert claim(relay, env) == ["last"]
        assert relay.marks.held == {} and relay.marks.floor < head


def test_more_parked_keys_than_held_keep_the_floor_below_the_first(
        env: Env, stores: Callable[[float], OutboxStore],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_HELD_KEYS keys whose head is parked, none is held: the floor stays below the
    first of their rows (a keyless parked row before it passed), as for every key before."""
    relay = stores(SHORT)
    with env.connect() as conn:
        add(conn, env, "later", due_in=86400.0)  # keyless and parked: passed either way
        first = add(conn, env, "k1", key="k", due_in=86400.0)
        add(conn, env, "k2", key="k")
        add(conn, env, "free")
        assert claim(relay, env) == ["free"]
        assert relay.marks.held == {"k": 0} and relay.marks.floor > first
        monkeypatch.setattr("outbox_relay.relay.store.MAX_HELD_KEYS", 1)
        add(conn, env, "j1", key="j", due_in=86400.0)
        time.sleep(SHORT)
        add(conn, env, "next")
        assert claim(relay, env) == ["next"]  # the keys let go: a look from below them
        time.sleep(SHORT)
        add(conn, env, "last")
        assert claim(relay, env) == ["last"]
        assert relay.marks.held == {} and relay.marks.floor == first - 1


def test_an_insert_begun_between_the_writers_read_and_the_snapshot_is_claimed(
        env: Env, stores: Callable[[float], OutboxStore]) -> None:
    """A producer's INSERT takes its id after the writers were read and before the claim's
    snapshot, and commits after the claim, while a later id commits before it. The first read
    cannot see that writer; the marks must not move past its id (they did: the row was never
    claimed by that relay again, full looks included)."""
    relay = stores(SHORT)
    read = relay._claim_writers.as_string(None).strip().rstrip(";")
    # The read before the snapshot, then 0.5 s in which the producers race in.
    slow_read = sql.SQL("SELECT ({}), pg_catalog.pg_sleep(0.5)").format(sql.SQL(read))
    with env.connect() as conn, env.connect() as producer:
        assert claim(relay, env) == []

        def race() -> None:
            time.sleep(0.2)
            producer.execute("BEGIN")
            # due before the claim's transaction began (its now())
            add(producer, env, "late", due_in=-60)  # its id is taken; committed after the claim
            add(conn, env, "early", due_in=-60)  # a later id, committed before the snapshot

        time.sleep(SHORT)  # the racy claim is a look from the floor: the floor moves too
        racer = threading.Thread(target=race)
        racer.start()
        reads = iter([slow_read])
        real_execute = relay.claim_conn.execute

        def execute(query: Any, *args: Any, **kwargs: Any) -> Any:
            if query is relay._claim_writers:
                query = next(reads, query)  # the first read of this claim only
            return real_execute(query, *args, **kwargs)

        relay.claim_conn.execute = execute  # type: ignore[method-assign]
        try:
            assert claim(relay, env) == ["early"]
        finally:
            del relay.claim_conn.execute
        racer.join()
        producer.commit()
        claim_until(relay, env, {"late"}, seconds=5.0)
