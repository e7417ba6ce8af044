"""The outbox in PostgreSQL: claim, prepare, finish, record failures. Steps 1, 2 and 5.

Two autocommit sessions. The claim session runs the claim transaction, opened with an explicit
BEGIN and ended by PREPARE TRANSACTION. The main session holds the relay's instance lock and
runs COMMIT/ROLLBACK PREPARED (which must run outside any transaction block) and the failure
bookkeeping: so the next batch can be claimed while this one is still being confirmed, and
this one committed while the next claim is open. The stats passes have a third session of
their own, on a thread of their own (``stats_session``).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from outbox_relay.errors import StandbyWaitTimeout, StartupCheckError, TransientError
from outbox_relay.model import OutboxRow
from outbox_relay.postgres import (
    MAX_HELD_BYTES,
    MAX_HELD_KEYS,
    PARK_HORIZON,
    StatsSession,
    check_create,
    check_server,
    check_standbys,
    connect_pinned,
    finish_prepared,
    read_ledger_key,
    translated,
    try_instance_lock,
    usable,
    warn_create,
    warn_key_readers,
    warn_unchecked,
)
from outbox_relay.prepared import PreparedStatement
from outbox_relay.relay.marks import ClaimMarks
from outbox_relay.rules import DEFAULT_MAX_MESSAGE_BYTES
from outbox_relay.schema import check_schema
from outbox_relay.tables import Tables

# Planner guards of the relay's sessions. An outbox swings between empty and full and its
# statistics lag behind, so a plan must be good in any state the planner may believe in:
# - The claim runs one plan per session, its generic plan: prepared once (CLAIM_STATEMENT,
#   outbox_relay/prepared.py) and run with plan_cache_mode = force_generic_plan. Planning it
#   at every claim took 0.6-0.9 ms of the 3 ms a claim and its COMMIT take at a steady load
#   (benchmarks.studies.claim_cost, benchmarks/NOTEBOOK.md). A generic plan is the one a
#   statement keeps however the table changes, until an ANALYZE or DDL of the table has it
#   rebuilt: test_plans.py builds it in each bad planner state (an empty table after VACUUM
#   truncated it, never analyzed, ...), then runs it on 50,000 rows, and checks that it
#   stays linear in the batch; that is what the guards below are for. A DDL that changes
#   the claim's result (a column's type) fails the claim: the session is closed and the next
#   one prepares the statement anew.
# - No other statement is prepared server-side (psycopg would after 5 executions): each is
#   planned against the table's current size, with its parameters. They run seldom (the
#   writers' and frontier reads once per 100 rows, the failure bookkeeping) or are small.
# - Sequential scans off wherever a statement touches a batch of rows (the claim session,
#   and the failure bookkeeping's transaction): such a statement always has an index path
#   linear in the batch, and a plan built on an empty table would otherwise read the whole
#   table, testing each row against the batch's id array. The stats run on a session of
#   their own (postgres.StatsSession), with their own planner guards.
# - Bitmap scans off in the claim session: the claim walks the primary key from the relay's
#   mark (relay/marks.py), and a bitmap scan of "id > mark" reads and sorts every row above
#   it, the whole backlog, before its LIMIT (a generic plan chose one, test_plans.py); an
#   index scan stops after the batch.
# - JIT off there too: a plan's cost is an estimate from stale statistics, and the claim's
#   per-key probes (queries.sql) can be costed far above jit_above_cost on a table believed
#   empty; compiling then took a second per claim (measured), for a statement that runs in
#   milliseconds.
CLAIM_SESSION_SETUP = ("SELECT set_config('enable_seqscan', 'off', false), "
                       "set_config('enable_bitmapscan', 'off', false), "
                       "set_config('jit', 'off', false), "
                       "set_config('plan_cache_mode', 'force_generic_plan', false)")
# The claim's prepared statement on the claim session (one per session, whatever the table).
CLAIM_STATEMENT = "outbox_relay_claim"

# Bytes a row may hold besides its payload (headers, text columns) and still be fetched. A row
# that can be published holds less: its header table fits frame_max, 128 KiB at most (what
# pika asks for; a broker may only lower it), and the table's JSON text takes 6 characters per
# byte of it at most ("null, " for a null, an escape for a control character: 768 KiB); its
# ordering key is a header too (128 KiB), and exchange, routing key, message id and content
# type are short strings (255 bytes each): 897 KiB. (A number counts in the table as 4 to 8
# bytes whatever digits jsonb keeps of it: only a table of numbers written with many
# thousands of digits could take more, and is refused.)
ROW_HEADROOM = 1 << 20

BATCH_STATEMENTS_SETUP = ("SELECT set_config('enable_seqscan', 'off', true), "
                          "set_config('jit', 'off', true)")


def without_prepare(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """Never prepare a statement server-side on ``conn`` (see above)."""
    conn.prepare_threshold = None
    return conn


def claim_session(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """Make ``conn`` a claim session: plans with sequential scans off, the generic one only
    for a prepared statement, none prepared by psycopg."""
    without_prepare(conn).execute(CLAIM_SESSION_SETUP)
    return conn


def standby_flushed_query(standby: str) -> str:
    """True once the standby OUTBOX_STANDBY_WAIT names (``any``: any streaming standby;
    ``sync``: a synchronous or quorum one) has flushed WAL up to %(lsn)s. Reading another
    session's positions in pg_stat_replication takes pg_read_all_stats (or pg_monitor)."""
    where = {"any": "true", "sync": "sync_state IN ('sync', 'quorum')"}.get(
        standby, "application_name = %(name)s")
    return ("SELECT coalesce(bool_or(flush_lsn >= %(lsn)s::pg_lsn), false) "
            f"FROM pg_stat_replication WHERE state = 'streaming' AND {where}")


def check_standby_wait_privilege(conn: psycopg.Connection[Any]) -> None:
    """OUTBOX_STANDBY_WAIT reads the standbys' positions in pg_stat_replication, which shows
    them to a superuser or a member of pg_read_all_stats (pg_monitor) only: without that, every
    batch would wait its whole timeout and be rolled back, publishing nothing."""
    row = conn.execute("SELECT rolsuper OR pg_catalog.pg_has_role(current_user, "
                       "'pg_read_all_stats', 'USAGE') FROM pg_catalog.pg_roles "
                       "WHERE rolname = current_user").fetchone()
    if not (row and row[0]):
        raise StartupCheckError(
            "OUTBOX_STANDBY_WAIT is set but this role may not read the standbys' positions in "
            "pg_stat_replication: GRANT pg_read_all_stats (or pg_monitor) TO it, or unset "
            "OUTBOX_STANDBY_WAIT")


def check_order_schema(conn: psycopg.Connection[Any], tables: Tables) -> None:
    """The claim's per-key order needs the key indexes and a read of dead-letter keys: without
    them it would read the table per row, or fail every claim. One clear line instead."""
    key_index, dead_letter_key_index = (name.as_string(None) for name in tables.key_indexes)
    row = conn.execute(tables.query("order_check"), {
        "key_index": key_index, "dead_letter_key_index": dead_letter_key_index,
        "dead_letter": tables.dead_letter.as_string(None)}).fetchone()
    assert row is not None
    has_key_indexes, reads_dead_letter_keys = row
    if not has_key_indexes:
        raise StartupCheckError(
            f"the ordering-key indexes of table {tables.name!r} do not exist (this version keeps "
            "per-key order with them): run `outbox-relay migrate`")
    if not reads_dead_letter_keys:
        raise StartupCheckError(
            f"this role may not read ordering_key of {tables.dead_letter_name!r} (the claim "
            "holds back a key that has a dead letter): grant it, e.g. by running sql/roles.sql "
            "again")


def claim_lock_key(table: str) -> int:
    """The advisory lock key that serializes the claims of ``table`` (a bigint)."""
    return zlib.crc32(f"outbox-relay claim {table}".encode())


# How long a claim made ahead (while the batch in flight waits for its confirms) waits for a
# table lock. None is ever taken against the claims but by a request for the whole table (a
# compaction's CLUSTER, an ALTER TABLE): queued behind it, the claim would keep the relay
# from finishing its batch, which holds the table, so neither would move until the request
# timed out (outbox-relay compact's every attempt at 2,000 events/s). It gives up instead.
AHEAD_LOCK_WAIT = "SET LOCAL lock_timeout = '10ms'"


class OutboxStore:
    """The relay's view of the outbox on one session-mode connection."""

    def __init__(self, url: str, table: str, *, connect_timeout: float = 10.0,
                 application_name: str = "outbox-relay", standby_wait: str = "",
                 standby_wait_timeout: float = 10.0) -> None:
        self._url = url
        self._table = table
        self._standby_wait = standby_wait
        self._standby_wait_timeout = standby_wait_timeout
        self._connect_timeout = connect_timeout
        self._application_name = application_name
        self.tables = Tables(table)
        self._conn: psycopg.Connection[Any] | None = None
        self._claim_conn: psycopg.Connection[Any] | None = None
        self._standbys_checked = False
        self._create_checked = False
        self._key_readers_checked = False
        self._claim = PreparedStatement(CLAIM_STATEMENT, self.tables.query("claim"))
        self._claim_writers = self.tables.query("claim_writers")
        self._claim_frontier = self.tables.query("claim_frontier")
        # Where each claim's walk starts (relay/marks.py); whether the open claim holds rows,
        # which come back below the mark if it is rolled back.
        self.marks = ClaimMarks()
        self._claim_holds_rows = False
        # Claims made ahead that gave up their table lock wait (AHEAD_LOCK_WAIT), so far.
        self.ahead_gave_up = 0
        self._claim_lock = (self.tables.query("claim_lock"), self.tables.query("claim_unlock"),
                            {"key": claim_lock_key(table)})
        # Rows asked for per claim while the byte budget binds: about twice what fit last time,
        # so few rows are locked beyond the budget (they stay locked until the batch ends).
        self._fitting: int | None = None
        # Read on connect: the key that signs this relay's ledger records, and the database's
        # name, which every record carries.
        self.ledger_key = b""
        self.database = ""

    @property
    def conn(self) -> psycopg.Connection[Any]:
        """The main session: instance lock, COMMIT/ROLLBACK PREPARED, failures."""
        return usable(self._conn)

    @property
    def claim_conn(self) -> psycopg.Connection[Any]:
        """The claim session: BEGIN, claim, dead-letter invalid rows, PREPARE TRANSACTION."""
        return usable(self._claim_conn)

    @property
    def connected(self) -> bool:
        return all(c is not None and not c.closed and not c.broken
                   for c in (self._conn, self._claim_conn))

    @translated
    def connect(self, lock_class: int, instance: int) -> None:
        """Connect, check the server and schema, and take this relay's instance lock."""
        self.close()
        # Both sessions pin search_path (postgres.pin_search_path) and name the tables with
        # the schema the table was found in.
        conn, self.tables = connect_pinned(self._url, self._table,
                                           timeout=self._connect_timeout,
                                           application_name=self._application_name)
        self._conn = without_prepare(conn)
        self._claim = PreparedStatement(CLAIM_STATEMENT, self.tables.query("claim"))
        self._claim_writers = self.tables.query("claim_writers")
        self._claim_frontier = self.tables.query("claim_frontier")
        self.marks.restart()
        self._claim_holds_rows = False
        check_server(self._conn, self.tables)
        check_schema(self._conn, self.tables)
        if self._standby_wait:
            check_standby_wait_privilege(self._conn)
        if not self._standbys_checked:  # once per process, not at every reconnect
            warn_unchecked(check_standbys(self._url, self._conn, self._connect_timeout))
            self._standbys_checked = True
        if not self._create_checked:
            warn_create(check_create(self._conn, self.tables))
            self._create_checked = True
        check_order_schema(self._conn, self.tables)
        self.ledger_key, self.database = read_ledger_key(self._conn, self.tables)
        if not self._key_readers_checked:  # once per process, not at every reconnect
            warn_key_readers(self._conn, self.tables)
            self._key_readers_checked = True
        # The lock lives as long as this session: the resolver takes it to learn we are gone.
        if not try_instance_lock(self._conn, lock_class, instance):
            self.close()
            raise TransientError("instance lock busy (a resolver is checking it); retrying")
        try:
            self._claim_conn = self.open_claim_session()
        except (TransientError, psycopg.Error):
            self.close()
            raise

    def open_claim_session(self) -> psycopg.Connection[Any]:
        """A new claim session: its planner guards set, the claim prepared."""
        conn = claim_session(connect_pinned(
            self._url, self._table, timeout=self._connect_timeout,
            application_name=f"{self._application_name} claim")[0])
        try:
            # created_at travels as text from the claim to a dead-letter insert on this session:
            # one fixed, unambiguous form.
            conn.execute("SET datestyle TO ISO, YMD")
            conn.execute("SET timezone TO UTC")
            self._claim.prepare(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def close(self) -> None:
        for conn in (self._claim_conn, self._conn):
            if conn is not None and not conn.closed:
                conn.close()
        self._conn = self._claim_conn = None

    @translated
    def reset(self) -> None:
        """Roll back an open (unprepared) transaction; close the sessions if even that fails."""
        for conn in (self._claim_conn, self._conn):
            if conn is None or conn.closed:
                continue
            try:
                if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    conn.execute("ROLLBACK")
                    if conn is self._claim_conn:
                        self._claim_abandoned()
            except psycopg.Error:
                self.close()
                return

    @translated
    def claim(self, limit: int, max_bytes: int, *,
              max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
              one_row_at_least: bool = True) -> list[OutboxRow]:
        """Step 1: BEGIN, then lock and delete up to ``limit`` due rows (SKIP LOCKED), about
        ``max_bytes`` of row data at most (one row at least, whatever its size, unless not
        ``one_row_at_least``: a claim ahead). A row too big to ever publish is moved to the
        dead-letter table by the claim itself, unfetched (its ``dead_reason`` set).

        Fetched in binary: the body (bytea) arrives as it is, not hex-encoded. Every column is
        of a type psycopg always loads (headers as text, created_at as float8 and text).
        """
        asked = min(limit, self._fitting or limit)
        conn = self.claim_conn
        after, full = self.marks.start()
        reads = self.marks.reads(full)
        floor = self.marks.floor
        held = Jsonb(self.marks.held)
        conn.execute("BEGIN")
        lock, unlock, key = self._claim_lock
        ahead = not one_row_at_least
        try:
            # One claim of this table at a time (queries.sql, claim_lock): lock, claim and
            # unlock are sent together, so the server never holds the lock waiting on us. A
            # claim that reads where the marks may move (relay/marks.py) reads the writers
            # before its snapshot and after it, its frontier after its deletes and the second
            # read. The claim is the session's prepared statement; prepare=False: psycopg
            # prepares nothing (CLAIM_SESSION_SETUP).
            with conn.pipeline(), conn.cursor(binary=True) as cur:
                conn.execute(lock, key, prepare=False)
                if ahead:
                    conn.execute(AHEAD_LOCK_WAIT, prepare=False)
                before = conn.execute(self._claim_writers, prepare=False) if reads else None
                cur.execute(self._claim.execute_query({
                    "limit": asked, "max_bytes": max_bytes,
                    "max_message_bytes": max_message_bytes,
                    "max_row_bytes": max_message_bytes + ROW_HEADROOM,
                    "one_row_at_least": one_row_at_least, "after": after, "floor": floor,
                    "held": held}),
                    prepare=False)
                if ahead:
                    conn.execute("SET LOCAL lock_timeout TO DEFAULT", prepare=False)
                after_claim = frontier = None
                if reads:
                    after_claim = conn.execute(self._claim_writers, prepare=False)
                    frontier = conn.execute(self._claim_frontier, {
                        "after": after, "floor": floor, "full": full, "held": held,
                        "max_held": MAX_HELD_KEYS, "max_held_bytes": MAX_HELD_BYTES,
                        "park_horizon": PARK_HORIZON},
                        prepare=False)
                conn.execute(unlock, key, prepare=False)
                fetched_rows = cur.fetchall()
                read = None
                if before is not None and after_claim is not None and frontier is not None:
                    read = before.fetchone(), after_claim.fetchone(), frontier.fetchone()
        except psycopg.errors.LockNotAvailable:
            if not ahead:
                conn.close()  # as below
                raise
            # The claim ahead waited AHEAD_LOCK_WAIT for the table: someone asked for it whole
            # (a compaction's VACUUM FULL, DDL). Nothing claimed: this batch finishes and frees
            # the table instead of waiting behind that request while holding it.
            try:
                conn.execute("ROLLBACK")
                conn.execute(unlock, key, prepare=False)
            except BaseException:
                conn.close()  # the claim lock goes with the session
                raise
            self._claim_holds_rows = False
            self.ahead_gave_up += 1
            return []
        except BaseException:
            conn.close()  # a failed pipeline skipped the unlock: the session takes the lock along
            raise
        rows = sorted((OutboxRow(*row) for row in fetched_rows), key=lambda r: r.id)
        self._claim_holds_rows = bool(rows)
        if read is None:
            self.marks.claimed_unread(len(rows))
        else:
            writers_row, writers_after_row, frontier_row = read
            assert writers_row is not None and writers_after_row is not None
            assert frontier_row is not None
            self.marks.observe(after=after, full=full, writers=writers_row[0],
                               writers_after=writers_after_row[0],
                               claimed=[(r.id, r.attempts <= 0) for r in rows],
                               waiting=frontier_row[0], first=frontier_row[1],
                               parked=None if frontier_row[2] is None
                               else (frontier_row[2], frontier_row[3]),
                               dead_keys=None if frontier_row[4] is None
                               else dict(zip(frontier_row[4], frontier_row[5] or [],
                                             strict=True)),
                               parked_keys=frontier_row[6])
        # RETURNING follows the executor, not ORDER BY: sorted, rows go out in insert order.
        fetched = sum(r.row_bytes for r in rows)
        if len(rows) < asked and 2 * fetched >= max_bytes:
            self._fitting = max(1, 2 * len(rows))  # the budget cut this claim
        elif len(rows) >= asked and asked == self._fitting:
            # It fit whole: grow back. (A claim asking for less, one made ahead behind keys in
            # flight, says nothing about what fits.)
            self._fitting = None if 2 * asked >= limit else 2 * asked
        return rows

    @translated
    def dead_letter_claimed(self, rows: Sequence[tuple[OutboxRow, str]]) -> None:
        """Inside the claim transaction: rows that can never be published go to dead letter,
        with the values the claim fetched (created_at as text from this same session, so it
        goes back exactly as it was, 'infinity' and BC dates included)."""
        params = [
            {"id": r.id, "message_id": r.message_id, "exchange": r.exchange,
             "routing_key": r.routing_key, "ordering_key": r.ordering_key,
             "is_json": r.is_json, "body": r.body, "headers": r.headers,
             "content_type": r.content_type, "message_type": r.message_type,
             "correlation_id": r.correlation_id, "created_at": r.created_at,
             "attempts": r.attempts, "error": error}
            for r, error in rows
        ]
        with self.claim_conn.cursor() as cur:
            cur.executemany(self.tables.query("dead_letter_claimed"), params)

    @translated
    def rollback(self) -> None:
        """End a claim that found nothing (or is abandoned) without preparing it."""
        self.claim_conn.execute("ROLLBACK")
        self._claim_abandoned()

    def _claim_abandoned(self) -> None:
        """The open claim was rolled back: its rows, if any, are back below the mark."""
        if self._claim_holds_rows:
            self.marks.rewind()
        self._claim_holds_rows = False

    @translated
    def prepare(self, gid: str) -> int:
        """Step 2: PREPARE TRANSACTION; checks that it really prepared. Returns the transaction's
        xid (as ``pg_prepared_xacts.transaction`` will show it), which the ledger record names.

        One round trip: the xid query and PREPARE go as one simple-protocol query string.
        """
        cur = self.claim_conn.execute(sql.SQL(
            "SELECT pg_current_xact_id()::xid::text::bigint; PREPARE TRANSACTION {}"
        ).format(sql.Literal(gid)))
        row = cur.fetchone()
        cur.nextset()
        # A transaction that already failed answers "ROLLBACK" without an error.
        if cur.statusmessage != "PREPARE TRANSACTION" or row is None:
            self._claim_abandoned()
            raise TransientError(f"PREPARE TRANSACTION answered {cur.statusmessage!r}")
        self._claim_holds_rows = False  # the batch's outcome decides now (finish)
        if self._standby_wait:
            self._wait_for_standby(gid)
        return int(row[0])

    def _wait_for_standby(self, gid: str) -> None:
        """OUTBOX_STANDBY_WAIT: return once the standby has flushed the WAL up to this claim.

        The claim's PREPARE follows every producer commit it claimed rows of, so a standby
        that flushed past it has those commits too: promoted, it cannot lack the data of an
        event the relay then publishes (no "ghost" events after an asynchronous failover).
        Past OUTBOX_STANDBY_WAIT_TIMEOUT the batch is rolled back (nothing was published)
        and the relay retries it after a backoff: no row counts an attempt.
        """
        lsn = self.claim_conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()
        assert lsn is not None
        query = standby_flushed_query(self._standby_wait)
        deadline = time.monotonic() + self._standby_wait_timeout
        pause = 0.0005
        while True:
            row = self.conn.execute(query, {"lsn": lsn[0], "name": self._standby_wait}).fetchone()
            if row is not None and row[0]:
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        finish_prepared(self.conn, gid, commit=False)
        self.marks.rewind()  # its rows are back
        raise StandbyWaitTimeout(
            f"standby {self._standby_wait!r} did not flush past the claim within "
            f"{self._standby_wait_timeout:g} s (OUTBOX_STANDBY_WAIT); batch rolled back")

    @translated
    def finish(self, gid: str, *, commit: bool) -> bool:
        """Step 5 (or the failure path): False if someone else already finished it."""
        done = finish_prepared(self.conn, gid, commit=commit)
        if not (done and commit):
            self.marks.rewind()  # its rows are back (or may be: a resolver's rollback)
        return done

    @translated
    def settle_failed(
        self,
        delivered: Sequence[int],
        failures: Mapping[int, str],
        attributed: Sequence[int],
        *,
        max_attempts: int,
        base_delay: float,
        max_delay: float,
    ) -> list[int]:
        """After ROLLBACK PREPARED: drop delivered rows, count failures, dead-letter the exhausted.

        Only rows whose failure was their own (``attributed``) can run out of attempts; a row
        that merely shared a batch with the culprit is retried alone instead.
        Returns the ids moved to the dead-letter table.
        """
        conn = self.conn
        with conn.transaction():
            conn.execute(BATCH_STATEMENTS_SETUP)  # index paths only, for this transaction
            if delivered:
                conn.execute(self.tables.query("forget_delivered"), {"ids": list(delivered)})
            if failures:
                conn.execute(
                    self.tables.query("record_failures"),
                    {"ids": list(failures),
                     "errors": Jsonb({str(row_id): error for row_id, error in failures.items()}),
                     "base_delay": base_delay, "max_delay": max_delay},
                )
            if not attributed:
                return []
            cur = conn.execute(self.tables.query("dead_letter_exhausted"),
                               {"ids": list(attributed), "max_attempts": max_attempts})
            return [row[0] for row in cur.fetchall()]

    @translated
    def dead_letter_rows(self, reasons: Mapping[int, str]) -> list[int]:
        """Outside any batch: move these rows to the dead-letter table, each with its reason.
        Returns the ids moved (a row another relay holds is not)."""
        if not reasons:
            return []
        conn = self.conn
        with conn.transaction():
            conn.execute(BATCH_STATEMENTS_SETUP)  # index paths only, for this transaction
            cur = conn.execute(self.tables.query("dead_letter_rows"), {
                "ids": list(reasons),
                "errors": Jsonb({str(row_id): error for row_id, error in reasons.items()})})
            return [row[0] for row in cur.fetchall()]

    @translated
    def keepalive(self) -> None:
        """A trivial statement on the main session: an idle relay's must not outlive the role's
        idle_session_timeout (it holds the instance lock)."""
        self.conn.execute("SELECT 1")

    def stats_session(self) -> StatsSession:
        """A new session for the stats passes, which run on a thread of their own
        (outbox_relay/runtime/stats.py): connected like this store's, not yet."""
        return StatsSession(self._url, self._table, connect_timeout=self._connect_timeout,
                            application_name=f"{self._application_name} stats")

    @translated
    def dead_letter_never_due(self, limit: int) -> list[tuple[int, str, str]]:
        """Move up to ``limit`` rows that are never due (available_at in the year 10000 or
        later) to the dead-letter table; a key's oldest row only. Returns (id, message_id,
        reason) of each row moved."""
        rows = self.conn.execute(self.tables.query("dead_letter_never_due"),
                                 {"limit": limit}).fetchall()
        return [(int(r[0]), str(r[1]), str(r[2])) for r in rows]
