"""Every hot statement stays linear in its batch in the worst planner state (issue 9).

An outbox is empty most of its life: its statistics say "empty" (0 pages, 0 tuples after a
VACUUM truncated it, or never analyzed; the columns' statistics may still describe the last
backlog, which an ANALYZE that samples no row keeps) when a burst of 50,000 rows arrives, and
a generic plan built in that state costs every scan at zero. The old claim then rescanned a
CTE for every outbox row: 50,000 x 2,000 tuple copies, about 10-20 s per claim. Here each
statement gets its plan built while the table is in a bad state, with the planner settings
the relay's sessions use (relay/store.py), cached as a generic plan (plan_cache_mode =
force_generic_plan: the plan the relay's claim session runs, and one any prepared statement
may keep); autovacuum is off for the table, so nothing replaces that plan. Then 50,000 rows
arrive and EXPLAIN ANALYZE runs the cached plan:

- no plan node runs more than once per execution: a per-row rescan of a CTE or subquery shows
  as a node run once per outbox row (their row locks are taken in an ARRAY(SELECT ...)
  InitPlan, run once). The one exception is the claim's per-key checks on rows with an
  ordering_key (sql/queries.sql): index probes of the key indexes (SubPlans, and the inner
  side of the claim's one join, a LATERAL read of each row's key head), at most one per
  batch row each, and each reads a few index entries;
- the rows all plan nodes handle (returned plus filtered out, times loops) stay within a small
  multiple of the batch: the statement never reads the table, let alone once per row;
- it runs in milliseconds (the bound is generous, the row count above is the exact check).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from outbox_relay.postgres import (
    BOUNDED_STATS_SETUP,
    MAX_HELD_BYTES,
    MAX_HELD_KEYS,
    PARK_HORIZON,
    stats_lowest_params,
    stats_params,
)
from outbox_relay.prepared import PreparedStatement
from outbox_relay.relay import store
from outbox_relay.relay.store import OutboxStore
from outbox_relay.tables import Tables
from tests.conftest import Env

pytestmark = pytest.mark.core  # run on every tested PostgreSQL (CONTRIBUTING.md)

ROWS = 50_000
BATCH = 2_000
RETRY_ROWS = 500  # failed before, due later: in the way of the fresh rows' id order
# The batch statements may handle each batch row a few times over (lock, delete, RETURNING)
# and step over the retry rows; a read of the table (50,000) or a rescan per row is far above.
WORK_BOUND = 15 * BATCH
# The claim passes its batch through a few window sorts, and a keyed batch through the per-key
# probes (each returns a row or two, once per row): still far from a per-row read of a table.
CLAIM_WORK_BOUND = 30 * BATCH
KEYS = 1000  # distinct ordering keys of the keyed rows: 2 per key in a batch
SECONDS_BOUND = 1.0  # measured: 2-10 ms; the old claim took 10-20 s here

STATES = ("vacuumed_empty", "never_analyzed", "analyzed_with_retry_rows_only",
          "vacuumed_empty_after_a_keyed_backlog")


def _insert(conn: psycopg.Connection[Any], table: sql.Identifier, count: int, *,
            attempts: int = 0, due_in: str = "0 s", keys: int | None = None) -> None:
    """``count`` rows; with ``keys``, ordering keys 'k0' to 'k<keys - 1>' round robin."""
    conn.execute(sql.SQL(
        "INSERT INTO {} (routing_key, ordering_key, payload, attempts, available_at) "
        "SELECT 'k', CASE WHEN %s::int IS NOT NULL THEN 'k' || n %% %s::int END, "
        "jsonb_build_object('n', n, 'pad', repeat('x', 200)), %s, now() + %s::interval "
        "FROM generate_series(1, %s) AS n").format(table),
        (keys, keys, attempts, due_in, count))


class Statement:
    """One named query, prepared on a session that is set up like the relay's."""

    def __init__(self, conn: psycopg.Connection[Any], tables: Tables, name: str,
                 setup: str | None = None) -> None:
        self.conn, self.name, self.setup = conn, name, setup
        self.prepared = PreparedStatement(f"hot_{name}", tables.query(name))
        self.prepared.prepare(conn)

    def _execute(self, prefix: str, params: dict[str, Any]) -> list[Any]:
        query = sql.SQL(prefix) + self.prepared.execute_query(params)
        with self.conn.transaction(force_rollback=True):
            if self.setup:
                self.conn.execute(self.setup)
            cur = self.conn.execute(query)
            return cur.fetchall() if cur.description else []

    def build_plan(self, params: dict[str, Any]) -> None:
        """Execute once (rolled back): the generic plan is built now, in the current state."""
        self._execute("", params)

    def explain(self, params: dict[str, Any], *, buffers: bool = False) -> dict[str, Any]:
        """EXPLAIN ANALYZE of the cached plan (rolled back), checked to be the generic one."""
        before = self._plans()
        options = "ANALYZE, BUFFERS, FORMAT JSON" if buffers else "ANALYZE, FORMAT JSON"
        rows = self._execute(f"EXPLAIN ({options}) ", params)
        generic, custom = self._plans()
        assert (generic, custom) == (before[0] + 1, 0), f"{self.name}: not a generic plan"
        return rows[0][0][0]  # type: ignore[no-any-return]

    def _plans(self) -> tuple[int, int]:
        row = self.conn.execute("SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                                "WHERE name = %s", (self.prepared.name,)).fetchone()
        assert row is not None
        return row[0], row[1]


# The claim's parameters as the relay passes them (a byte budget the batch does not reach).
CLAIM = {"limit": BATCH, "max_bytes": 16 << 20, "max_message_bytes": 128 << 20,
         "max_row_bytes": (128 << 20) + store.ROW_HEADROOM, "one_row_at_least": True,
         "after": 0, "floor": 0, "held": Jsonb({})}


# The frontier's other parameters as the relay passes them (no key held).
FRONTIER = {"held": Jsonb({}), "max_held": MAX_HELD_KEYS, "max_held_bytes": MAX_HELD_BYTES,
            "park_horizon": PARK_HORIZON}


def batch_params(fresh_ids: list[int], retry_ids: list[int]) -> dict[str, dict[str, Any]]:
    return {
        "claim": CLAIM,
        "forget_delivered": {"ids": fresh_ids},
        "record_failures": {"ids": fresh_ids,
                            "errors": Jsonb({str(i): "nacked" for i in fresh_ids}),
                            "base_delay": 1.0, "max_delay": 60.0},
        "dead_letter_exhausted": {"ids": retry_ids, "max_attempts": 3},
        # The full pass; the bounded one: test_stats_floor.py.
        "stats": stats_params(0),
        "stats_lowest": stats_lowest_params(0),
    }


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def rows_in(plan: dict[str, Any]) -> float:
    """Rows a statement produced (for an INSERT, UPDATE or DELETE: the rows it changed)."""
    if plan["Node Type"] != "ModifyTable":
        return plan["Actual Rows"]  # type: ignore[no-any-return]
    return next(p for p in plan["Plans"] if p["Parent Relationship"] == "Outer")["Actual Rows"]  # type: ignore[no-any-return]


def work(plan: dict[str, Any]) -> float:
    """Rows handled by every node: returned and filtered out, per loop times loops."""
    keys = ("Actual Rows", "Rows Removed by Filter", "Rows Removed by Join Filter",
            "Rows Removed by Index Recheck")
    return sum(sum(node.get(k, 0) for k in keys) * node["Actual Loops"] for node in nodes(plan))


def _set_state(conn: psycopg.Connection[Any], tables: Tables, state: str) -> None:
    """Put the empty table in ``state``; autovacuum never visits it (nothing replans)."""
    conn.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(tables.outbox))
    if state == "vacuumed_empty":
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(tables.outbox))
    elif state == "analyzed_with_retry_rows_only":
        # The statistics say: every row failed before, and none is due.
        _insert(conn, tables.outbox, 1000, attempts=3, due_in="1 hour")
        conn.execute(sql.SQL("ANALYZE {}").format(tables.outbox))
        conn.execute(sql.SQL("DELETE FROM {}").format(tables.outbox))
    elif state == "vacuumed_empty_after_a_keyed_backlog":
        # A drained outbox: 0 pages and 0 rows, as after vacuumed_empty, but its columns keep
        # the statistics of the backlog it last held (an ANALYZE that samples no row leaves
        # them), here many keyed rows: a key's rows look few and far apart.
        _insert(conn, tables.outbox, ROWS, keys=ROWS // 5)
        conn.execute(sql.SQL("ANALYZE {}").format(tables.outbox))
        conn.execute(sql.SQL("DELETE FROM {}").format(tables.outbox))
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(tables.outbox))


def _pg_class(conn: psycopg.Connection[Any], tables: Tables) -> tuple[int, float]:
    row = conn.execute("SELECT relpages, reltuples FROM pg_class WHERE oid = %s::regclass",
                       (tables.outbox.as_string(conn),)).fetchone()
    assert row is not None
    return row[0], row[1]


def _ids(conn: psycopg.Connection[Any], tables: Tables, *, attempts: int) -> list[int]:
    return [row[0] for row in conn.execute(sql.SQL(
        "SELECT id FROM {} WHERE attempts = %s ORDER BY id").format(tables.outbox), (attempts,))]


def _key_probe(top: dict[str, Any], target: dict[str, Any]) -> bool:
    """True if ``target`` is in a SubPlan, or the inner side of a join, that reads only the key
    indexes (the claim's LATERAL probe of a row's key: a per-key check) or one row by its ctid
    (the claim's lock of each row it chose): one probe per row."""
    def walk(node: dict[str, Any], probe: bool) -> bool:
        if node.get("Parent Relationship") in ("SubPlan", "Inner"):
            probe = all(n.get("Index Name", "").endswith("key_idx")
                        or n["Node Type"] == "Tid Scan"
                        for n in nodes(node) if "Relation Name" in n)
        if node is target:
            return probe
        return any(walk(child, probe) for child in node.get("Plans", []))

    return walk(top, False)


@pytest.mark.parametrize("keyed", [False, True], ids=["no_keys", "keys"])
@pytest.mark.parametrize("state", STATES)
def test_hot_statements_stay_linear_with_a_generic_plan_built_on_an_empty_table(
        env: Env, state: str, keyed: bool) -> None:
    tables = Tables(env.table)
    with env.connect() as admin, env.connect() as claim_conn, env.connect() as main_conn:
        _set_state(admin, tables, state)
        before = _pg_class(admin, tables)
        store.claim_session(claim_conn)
        store.without_prepare(main_conn)
        for conn in (claim_conn, main_conn):
            conn.execute("SET plan_cache_mode = force_generic_plan")
        statements = [Statement(claim_conn, tables, "claim")] + [
            Statement(main_conn, tables, name, store.BATCH_STATEMENTS_SETUP)
            for name in ("forget_delivered", "record_failures", "dead_letter_exhausted")
        ] + [Statement(main_conn, tables, "stats"),
             Statement(main_conn, tables, "stats_lowest", BOUNDED_STATS_SETUP)]
        for statement in statements:
            statement.build_plan(batch_params([1, 2, 3], [4, 5])[statement.name])

        # Failed before and not due yet: the retry branch finds nothing to claim, the fresh
        # branch steps over them (they come first in id order).
        # With keys: the retry rows hold no key back (they have keys of their own).
        keys = KEYS if keyed else None
        _insert(admin, tables.outbox, RETRY_ROWS, attempts=3, due_in="1 hour",
                keys=None if keys is None else RETRY_ROWS)
        if keyed:
            admin.execute(sql.SQL("UPDATE {} SET ordering_key = 'r' || ordering_key").format(
                tables.outbox))
        _insert(admin, tables.outbox, ROWS, keys=keys)
        assert _pg_class(admin, tables) == before  # the planner still believes the old state
        fresh = _ids(admin, tables, attempts=0)
        params = batch_params(fresh[ROWS // 2:ROWS // 2 + BATCH],
                              _ids(admin, tables, attempts=3))

        for statement in statements:
            name = statement.name
            plan = statement.explain(params[name])
            top = plan["Plan"]
            rescanned = [(n["Node Type"], n["Actual Loops"]) for n in nodes(top)
                         if n["Actual Loops"] > 1 and not _under_gather(top, n)
                         and not _key_probe(top, n)]
            assert not rescanned, f"{name} rescans per row: {rescanned}\n{plan}"
            probes = [n["Actual Loops"] for n in nodes(top) if _key_probe(top, n)]
            assert max(probes, default=0) <= BATCH, f"{name}: {probes}\n{plan}"
            if keyed and name == "claim":
                assert max(probes, default=0) > 0, plan  # the keyed rows were checked
            bound = {"stats": 2 * (ROWS + RETRY_ROWS), "claim": CLAIM_WORK_BOUND}.get(
                name, WORK_BOUND)
            assert work(top) <= bound, f"{name} handles {work(top):,.0f} rows\n{plan}"
            assert plan["Execution Time"] < SECONDS_BOUND * 1000, f"{name}\n{plan}"
            expected = {"claim": BATCH, "forget_delivered": BATCH, "record_failures": BATCH,
                        "dead_letter_exhausted": RETRY_ROWS, "stats": 1,
                        "stats_lowest": 1}[name]
            assert rows_in(top) == expected, f"{name}\n{plan}"


def _under_gather(top: dict[str, Any], target: dict[str, Any]) -> bool:
    """True if ``target`` runs in parallel workers (its loops count processes, not rescans)."""
    def walk(node: dict[str, Any], parallel: bool) -> bool:
        if node is target:
            return parallel
        inside = parallel or node["Node Type"] in ("Gather", "Gather Merge")
        return any(walk(child, inside) for child in node.get("Plans", []))

    return walk(top, False)


def test_a_due_retry_row_is_claimed_alone_and_no_fresh_row_is_locked(env: Env) -> None:
    tables = Tables(env.table)
    with env.connect() as admin, env.connect() as claim_conn, env.connect() as other:
        _set_state(admin, tables, "vacuumed_empty")
        store.claim_session(claim_conn)
        claim_conn.execute("SET plan_cache_mode = force_generic_plan")
        claim = Statement(claim_conn, tables, "claim")
        claim.build_plan(CLAIM)
        _insert(admin, tables.outbox, 5_000)
        _insert(admin, tables.outbox, 1, attempts=1, due_in="-1 s")

        plan = claim.explain(CLAIM)["Plan"]
        assert rows_in(plan) == 1
        fresh = [n for n in nodes(plan) if n.get("Alias") == "decided"]
        assert fresh and fresh[0]["Actual Loops"] == 0, plan  # never executed

        # The same through the relay's session: nothing but the retry row is locked.
        with claim_conn.transaction(force_rollback=True):
            claim_conn.execute("RESET plan_cache_mode")
            rows = claim_conn.execute(tables.query("claim"), CLAIM).fetchall()
            assert [r[11] for r in rows] == [1]  # attempts
            free = other.execute(sql.SQL(
                "SELECT count(*) FROM (SELECT id FROM {} FOR UPDATE SKIP LOCKED) AS free").format(
                tables.outbox)).fetchone()
            assert free == (5_000,)


def test_the_relay_store_claims_fast_after_many_claims_on_an_empty_table(env: Env) -> None:
    """The real code path: more claims than psycopg's prepare threshold on the empty table,
    then a burst. The claim is the one statement prepared server-side, its plan the generic
    one built on the empty table (the tests above check that plan's shape), and the burst's
    first claim takes ms."""
    tables = Tables(env.table)
    relay = OutboxStore(env.db_url, env.table)
    with env.connect() as admin:
        _set_state(admin, tables, "vacuumed_empty")
        relay.connect(lock_class=1, instance=0x1D1E)
        try:
            for _ in range(10):
                assert relay.claim(BATCH, 16 << 20) == []
                relay.rollback()
            _insert(admin, tables.outbox, ROWS)
            started = time.monotonic()
            rows = relay.claim(BATCH, 16 << 20)
            seconds = time.monotonic() - started
            relay.rollback()
            assert len(rows) == BATCH and [r.id for r in rows] == sorted(r.id for r in rows)
            assert seconds < SECONDS_BOUND
            prepared = relay.claim_conn.execute(
                "SELECT name, generic_plans, custom_plans FROM pg_prepared_statements"
            ).fetchall()
            assert prepared == [(store.CLAIM_STATEMENT, 11, 0)]
            assert relay.conn.execute("SELECT count(*) FROM pg_prepared_statements"
                                      ).fetchone() == (0,)
            assert relay.claim_conn.execute("SHOW enable_seqscan").fetchone() == ("off",)
            assert relay.conn.execute("SHOW enable_seqscan").fetchone() == ("on",)

            # The failure bookkeeping: each row keeps its own error (a jsonb lookup by id).
            first, second = rows[0].id, rows[1].id
            relay.settle_failed([rows[2].id], {first: "nacked", second: "unroutable"}, [],
                                max_attempts=3, base_delay=1.0, max_delay=60.0)
            kept = dict(admin.execute(sql.SQL(
                "SELECT id, last_error FROM {} WHERE id = ANY(%s)").format(tables.outbox),
                ([first, second, rows[2].id],)).fetchall())
            assert kept == {first: "nacked", second: "unroutable"}
        finally:
            relay.close()


def test_the_resolvers_scans_read_shared_memory_only_never_the_outbox(env: Env) -> None:
    """The resolver's scans (prepared_of_prefix, xmin_horizon; outbox_stats is `stats` above)
    and its watch, every 0.1 s, read system views only: with a full outbox whose statistics say
    empty, and generic plans, no plan node touches the outbox, and none runs more often than
    there are sessions and prepared transactions (a few dozen here)."""
    tables = Tables(env.table)
    prefix = env.gid_prefix + ":"
    with env.connect() as admin, env.connect() as conn, env.connect() as relay_conn:
        _set_state(admin, tables, "vacuumed_empty")
        store.without_prepare(conn)
        conn.execute("SET plan_cache_mode = force_generic_plan")
        lock_class = 7
        relay_conn.execute("SELECT pg_advisory_lock(%s, %s)", (lock_class, 0x11))
        scans = [Statement(conn, tables, name)
                 for name in ("prepared_of_prefix", "xmin_horizon", "watch")]
        params = {"prefix": prefix, "class": lock_class,
                  "ledger_key": tables.ledger_key.as_string(None)}
        for statement in scans:
            statement.build_plan(params)
        _insert(admin, tables.outbox, ROWS)
        gids = [f"{env.gid_prefix}:{instance:08x}:1" for instance in (0x11, 0x12)]
        for gid in gids:  # one batch of a live relay (lock held), one of a dead one
            with psycopg.connect(env.db_url) as preparing:
                # SKIP LOCKED: the row the first batch deleted stays locked by its prepared
                # transaction; deleting it again would wait for ever.
                preparing.execute(sql.SQL(
                    "DELETE FROM {} WHERE id = (SELECT id FROM {} ORDER BY id LIMIT 1"
                    " FOR UPDATE SKIP LOCKED)").format(tables.outbox, tables.outbox))
                preparing.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        try:
            for statement in scans:
                plan = statement.explain(params)
                top = plan["Plan"]
                text = str(plan)
                assert tables.outbox.as_string(conn).strip('"') not in text, text
                loops = max(n["Actual Loops"] for n in nodes(top))
                assert loops <= 100, f"{statement.name}: a node ran {loops} times\n{plan}"
                assert plan["Execution Time"] < SECONDS_BOUND * 1000, plan
            row = conn.execute(tables.query("watch"), params).fetchone()
            assert row is not None and sorted(row[0]) == gids and row[1] == [0x11]
        finally:
            for gid in gids:
                admin.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))


def _explain_claim(claim_conn: psycopg.Connection[Any], tables: Tables) -> dict[str, Any]:
    """The claim's plan, run (rolled back) on ``claim_conn`` made a claim session."""
    store.claim_session(claim_conn)
    with claim_conn.transaction(force_rollback=True):
        explained = claim_conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) ") + tables.query("claim"), CLAIM).fetchone()
    assert explained is not None
    return explained[0][0]["Plan"]  # type: ignore[no-any-return]


def test_rows_other_transactions_hold_are_stepped_over_before_the_key_probes(env: Env) -> None:
    """A batch in flight (prepared) and a claim made ahead (open) hold the first rows: the claim
    steps over them by their xmax, never probing their keys (before, each was probed and then
    skipped by SKIP LOCKED: with 4 relays, up to 16,000 rows a claim). Rows whose xmax is only
    left over (a claim rolled back) or a multixact (two share locks, both ended) are claimed."""
    tables = Tables(env.table)
    gid = f"{env.table}-held-batch"
    with env.connect() as admin, env.connect() as claim_conn, env.connect() as ahead, \
            env.connect() as first, env.connect() as second:
        _insert(admin, tables.outbox, 3 * BATCH, keys=3 * BATCH)  # a key of its own each
        ids = _ids(admin, tables, attempts=0)
        lock = sql.SQL("SELECT id FROM {} WHERE id = ANY(%s) FOR {}").format
        admin.execute("BEGIN")
        admin.execute(sql.SQL("DELETE FROM {} WHERE id = ANY(%s)").format(tables.outbox),
                      (ids[:BATCH],))
        admin.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        try:
            with ahead.transaction():
                ahead.execute(lock(tables.outbox, sql.SQL("UPDATE")), (ids[BATCH:2 * BATCH],))
                with first.transaction(force_rollback=True):
                    first.execute(lock(tables.outbox, sql.SQL("UPDATE")),
                                  (ids[2 * BATCH:2 * BATCH + 10],))
                shared = ids[2 * BATCH + 10:2 * BATCH + 20]
                with first.transaction(), second.transaction():
                    for conn in (first, second):
                        conn.execute(lock(tables.outbox, sql.SQL("SHARE")), (shared,))
                left = dict(admin.execute(sql.SQL(
                    "SELECT id, xmax::text::bigint FROM {} WHERE id = ANY(%s)").format(
                    tables.outbox), (ids[2 * BATCH:2 * BATCH + 20],)).fetchall())
                assert all(left.values()), left  # every one of them has an xmax left over

                plan = _explain_claim(claim_conn, tables)
                probes = [n["Actual Loops"] for n in nodes(plan) if _key_probe(plan, n)]
                assert probes and max(probes) <= BATCH, f"{probes}\n{plan}"
                with claim_conn.transaction(force_rollback=True):
                    rows = claim_conn.execute(tables.query("claim"), CLAIM).fetchall()
                assert sorted(r[0] for r in rows) == ids[2 * BATCH:]
        finally:
            admin.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))


def test_the_claim_sorts_a_keyed_batch_once(env: Env) -> None:
    """The claim's windows want the batch in id order (the byte budget) and in key order (the
    per-key checks, at two levels): the rows come locked in id order already, and with the
    key window named first, the first level hands the second its rows in key order
    (sql/queries.sql). One sort of the batch, by key."""
    tables = Tables(env.table)
    with env.connect() as admin, env.connect() as claim_conn:
        _insert(admin, tables.outbox, 2 * BATCH, keys=KEYS)
        plan = _explain_claim(claim_conn, tables)
        sorts = [n["Sort Key"] for n in nodes(plan) if n["Node Type"] == "Sort"]
        assert len(sorts) == 1 and "ordering_key" in sorts[0][0], f"{sorts}\n{plan}"
        assert max(n["Actual Rows"] for n in nodes(plan) if n["Node Type"] == "Sort") == BATCH


# Rows claimed (deleted) while another session holds a snapshot: their dead tuples and index
# entries stay, VACUUM may not remove them (issue 36).
HELD_DEAD = 50 * BATCH  # 100,000: about 3,500 pages of dead tuples


def buffers(explained: dict[str, Any]) -> int:
    """Buffers a statement touched (hit or read): inclusive at the top node, its InitPlans,
    SubPlans and CTEs included. A dead index entry costs a visit of its heap tuple."""
    top = explained["Plan"]
    return int(top["Shared Hit Blocks"] + top["Shared Read Blocks"])


@pytest.mark.parametrize("keyed", [False, True], ids=["no_keys", "keys"])
@pytest.mark.parametrize("state", STATES)
def test_the_claims_work_stays_bounded_by_the_batch_while_a_snapshot_is_held(
        env: Env, state: str, keyed: bool) -> None:
    """Issue 36: while a snapshot is held, every claimed row stays behind as a dead tuple and a
    dead index entry, in front of the due rows. The claim and its frontier start after the
    relay's mark (relay/marks.py), the stats full pass's walks below the lowest id it saw
    (stats_lowest): the buffers they touch stay what a batch costs with no dead
    entries at all, with 50 batches' worth of them in front; the same claim from the start
    of the primary key (the look from the floor when a row held back for long pins it at
    the start) visits every one of them. Plans built in each bad planner state, cached."""
    tables = Tables(env.table)
    keys = KEYS if keyed else None
    with env.connect() as admin, env.connect() as claim_conn, env.connect() as holder:
        _set_state(admin, tables, state)
        store.claim_session(claim_conn)
        claim_conn.execute("SET plan_cache_mode = force_generic_plan")
        claim = Statement(claim_conn, tables, "claim")
        frontier = Statement(claim_conn, tables, "claim_frontier")
        # The stats full pass's walks, from below the lowest id it saw (not the claims').
        lowest = Statement(claim_conn, tables, "stats_lowest", BOUNDED_STATS_SETUP)
        claim.build_plan(CLAIM)
        frontier.build_plan({**FRONTIER, "after": 0, "floor": 0, "full": False})
        lowest.build_plan(stats_lowest_params(0))

        _insert(admin, tables.outbox, BATCH, keys=keys)
        mark = min(_ids(admin, tables, attempts=0)) - 1
        at = {**FRONTIER, "after": mark, "floor": mark}
        walks = stats_lowest_params(mark)
        alone = {"claim": buffers(claim.explain({**CLAIM, **at}, buffers=True)),
                 "frontier": buffers(frontier.explain({**at, "full": True}, buffers=True)),
                 "stats_lowest": buffers(lowest.explain(walks, buffers=True))}

        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute(sql.SQL("SELECT count(*) FROM {}").format(tables.outbox))  # held
        _insert(admin, tables.outbox, HELD_DEAD, keys=keys)
        admin.execute(sql.SQL("DELETE FROM {}").format(tables.outbox))  # claimed, all of them
        admin.execute(sql.SQL("VACUUM {}").format(tables.outbox))  # removes none of them
        dead = admin.execute("SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = %s::regclass",
                             (tables.outbox.as_string(admin),)).fetchone()
        assert dead is not None and dead[0] >= HELD_DEAD
        pages = admin.execute("SELECT pg_relation_size(%s::regclass) / 8192",
                              (tables.outbox.as_string(admin),)).fetchone()
        assert pages is not None
        _insert(admin, tables.outbox, BATCH, keys=keys)
        mark = min(_ids(admin, tables, attempts=0)) - 1
        at = {**FRONTIER, "after": mark, "floor": mark}

        claimed = claim.explain({**CLAIM, **at}, buffers=True)
        assert rows_in(claimed["Plan"]) == BATCH
        looked = frontier.explain({**at, "full": True}, buffers=True)
        walked = lowest.explain(stats_lowest_params(mark), buffers=True)
        behind = {"claim": buffers(claimed), "frontier": buffers(looked),
                  "stats_lowest": buffers(walked)}
        plans = {"claim": claimed, "frontier": looked, "stats_lowest": walked}
        for name, used in behind.items():
            assert used <= 2 * alone[name] + 100, (
                f"{name}: {used} buffers, {alone[name]} alone\n{_buffer_nodes(plans[name])}")
        from_start = claim.explain({**CLAIM, "after": 0, "floor": 0}, buffers=True)
        assert rows_in(from_start["Plan"]) == BATCH
        # What the test would see if the claim walked the dead entries (and each key's, per
        # probe): every page of dead tuples at least.
        assert buffers(from_start) >= behind["claim"] + pages[0] // 2, (
            buffers(from_start), behind, pages[0])
        holder.rollback()


@pytest.mark.parametrize("state", STATES)
def test_the_stats_full_pass_reads_the_rows_held_below_its_floor_by_id(
        env: Env, state: str) -> None:
    """A scheduled event with an ordering key, and its key's next row behind it, lie below
    every dead entry a held snapshot keeps: the full pass's stats_lowest reads the rows at or
    below the passes' floor by id, as the stats aggregate listed them, and walks from the
    floor. Its buffers stay what they are with no dead entries; the same walks from the
    lowest row (past MAX_LISTED rows there) visit every one of them. Plans built in each bad
    planner state, cached; the answers the same either way."""
    tables = Tables(env.table)
    with env.connect() as admin, env.connect() as conn, env.connect() as holder:
        _set_state(admin, tables, state)
        conn.execute("SET plan_cache_mode = force_generic_plan")
        lowest = Statement(conn, tables, "stats_lowest", BOUNDED_STATS_SETUP)
        lowest.build_plan(stats_lowest_params(0))
        held = [row[0] for row in admin.execute(sql.SQL(
            "INSERT INTO {} (routing_key, ordering_key, payload, available_at) "
            "VALUES ('k', 'parked', '{{}}', now() + interval '1 day'), "
            "('k', 'parked', '{{}}', now()) RETURNING id").format(tables.outbox))]
        _insert(admin, tables.outbox, BATCH, keys=KEYS)
        floor = min(_ids(admin, tables, attempts=0)[2:]) - 1
        listed = stats_lowest_params(held[0] - 1, held, floor)
        alone = buffers(lowest.explain(listed, buffers=True))

        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute(sql.SQL("SELECT count(*) FROM {}").format(tables.outbox))  # held
        _insert(admin, tables.outbox, HELD_DEAD, keys=KEYS)
        admin.execute(sql.SQL("DELETE FROM {} WHERE id > %s").format(tables.outbox),
                      (held[1],))  # claimed, all but the key held behind its scheduled head
        admin.execute(sql.SQL("VACUUM {}").format(tables.outbox))  # removes none of them
        pages = admin.execute("SELECT pg_relation_size(%s::regclass) / 8192",
                              (tables.outbox.as_string(admin),)).fetchone()
        assert pages is not None
        _insert(admin, tables.outbox, BATCH, keys=KEYS)
        floor = min(_ids(admin, tables, attempts=0)[2:]) - 1
        with admin.transaction():
            row = admin.execute(tables.query("stats"), stats_params(0, floor=floor)).fetchone()
        assert row is not None and sorted(row[5]) == held  # the aggregate lists them
        listed = stats_lowest_params(held[0] - 1, sorted(row[5]), floor)
        walked = lowest.explain(listed, buffers=True)
        assert buffers(walked) <= 2 * alone + 100, (
            f"{buffers(walked)} buffers, {alone} alone\n{_buffer_nodes(walked)}")
        from_lowest = lowest.explain(stats_lowest_params(held[0] - 1), buffers=True)
        assert buffers(from_lowest) >= buffers(walked) + pages[0] // 2, (
            buffers(from_lowest), buffers(walked), pages[0])
        answers = [admin.execute(tables.query("stats_lowest"), params).fetchone()
                   for params in (listed, stats_lowest_params(held[0] - 1))]
        assert answers[0] is not None and answers[1] is not None
        assert answers[0][:5] == answers[1][:5]  # the last, a lag, is the time of each
        assert answers[0][1] == floor + 1  # lowest_due
        assert (answers[0][2], answers[0][4]) == ({"parked": held[0]}, 2)
        holder.rollback()


def _buffer_nodes(explained: dict[str, Any]) -> str:
    return "\n".join(f"{n['Node Type']} {n.get('Index Name', '')} {n.get('Index Cond', '')} "
                     f"{n.get('Filter', '')[:80]} hit={n['Shared Hit Blocks']} "
                     f"loops={n['Actual Loops']}" for n in nodes(explained["Plan"]))
