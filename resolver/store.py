"""The resolver's PostgreSQL session: prepared transactions, instance locks, COMMIT/ROLLBACK
PREPARED, and what the metrics read. psycopg's errors stop at this edge
(outbox_relay.postgres.translate)."""

from __future__ import annotations

from typing import Any

import psycopg
import psycopg.errors

from outbox_relay import postgres
from outbox_relay.compact import Sizes
from outbox_relay.model import HorizonHolder, PreparedXact, SessionRole
from outbox_relay.resolver.compaction import Compaction
from outbox_relay.schema import check_schema
from outbox_relay.tables import Tables


def blocked_keys(conn: psycopg.Connection[Any], tables: Tables) -> int:
    row = conn.execute(tables.query("blocked_keys")).fetchone()
    assert row is not None
    return int(row[0])


def prepared_of_prefix(conn: psycopg.Connection[Any], prefix: str,
                       ledger_key: str) -> list[PreparedXact]:
    """This database's prepared transactions of ``prefix``, oldest first; ``ledger_key`` is
    the key table's quoted name (whether each owner may read it)."""
    rows = conn.execute(Tables("outbox").query("prepared_of_prefix"),
                        {"prefix": prefix + ":", "ledger_key": ledger_key})
    return [PreparedXact(*row) for row in rows]


def session_role(conn: psycopg.Connection[Any]) -> SessionRole:
    row = conn.execute(Tables("outbox").query("session_role")).fetchone()
    assert row is not None
    return SessionRole(row[0], bool(row[1]))


def xmin_horizon(conn: psycopg.Connection[Any], prefix: str) -> dict[str, HorizonHolder]:
    """{holder kind: its oldest xid}; kinds: outbox_prepared (this gid prefix), other_prepared,
    session, replication_slot. Kinds holding nothing are left out."""
    rows = conn.execute(Tables("outbox").query("xmin_horizon"), {"prefix": prefix + ":"})
    return {holder: HorizonHolder(int(xid_age), age_seconds, oldest_xid)
            for holder, xid_age, age_seconds, oldest_xid in rows}


def prepared_slots(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """(prepared transactions of the whole server, max_prepared_transactions)."""
    row = conn.execute(Tables("outbox").query("prepared_slots")).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


class StatsSession(postgres.StatsSession):
    """The resolver's stats session: the outbox's stats, the keys held back behind a dead
    letter, the table's size, and its compaction after a held snapshot."""

    @postgres.translated
    def blocked_keys(self) -> int:
        return blocked_keys(self.session, self.tables)

    @postgres.translated
    def sizes(self) -> Sizes:
        return Sizes.read(self.session, self.tables)

    @postgres.translated
    def compact_if_due(self, compaction: Compaction, sizes: Sizes) -> None:
        compaction.run_if_due(self.session, self.tables, sizes)


class PostgresPreparedStore:
    """One autocommit session of the resolver (the ``PreparedStore`` of resolver/worker.py)."""

    def __init__(self, url: str, table: str, *, connect_timeout: float) -> None:
        self._url = url
        self._connect_timeout = connect_timeout
        self.tables = Tables(table)
        self._conn: psycopg.Connection[Any] | None = None
        self._table = table
        self._standbys_checked = False
        self._create_checked = False
        self._key_readers_checked = False
        self.ledger_key = b""  # read on connect
        self.role = SessionRole("", superuser=False)

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed and not self._conn.broken

    @postgres.translated
    def connect(self) -> None:
        """Connect, fail fast on 2PC off or a missing or unusable schema, read the ledger key and
        our role."""
        self.close()
        # search_path pinned, tables named with their schema (postgres.pin_search_path).
        conn, self.tables = postgres.connect_pinned(self._url, self._table,
                                                    timeout=self._connect_timeout,
                                                    application_name="outbox-resolver")
        try:
            postgres.check_server(conn)
            check_schema(conn, self.tables)
            if not self._standbys_checked:  # once per process, not at every reconnect
                postgres.warn_unchecked(postgres.check_standbys(self._url, conn, self._connect_timeout))
                self._standbys_checked = True
            if not self._create_checked:
                postgres.warn_create(postgres.check_create(conn, self.tables))
                self._create_checked = True
            self.ledger_key, _database = postgres.read_ledger_key(conn, self.tables)
            if not self._key_readers_checked:  # once per process
                postgres.warn_key_readers(conn, self.tables)
                self._key_readers_checked = True
            self.role = session_role(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def close(self) -> None:
        """Ends the session, and with it every advisory lock it holds."""
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            conn.close()

    @property
    def _session(self) -> psycopg.Connection[Any]:
        return postgres.usable(self._conn)

    @postgres.translated
    def prepared(self, prefix: str) -> list[PreparedXact]:
        """This database's prepared transactions of ``prefix``, oldest first."""
        return prepared_of_prefix(self._session, prefix, self.tables.ledger_key.as_string(None))

    @postgres.translated
    def try_instance_lock(self, lock_class: int, instance: int) -> bool:
        return postgres.try_instance_lock(self._session, lock_class, instance)

    @postgres.translated
    def instance_unlock(self, lock_class: int, instance: int) -> None:
        postgres.instance_unlock(self._session, lock_class, instance)

    @postgres.translated
    def finish(self, gid: str, *, commit: bool) -> bool:
        """COMMIT or ROLLBACK PREPARED; False when the transaction the scan saw is gone.

        Gone also when PostgreSQL says the gid now belongs to another role (42501) or database
        (0A000): the scan checked the owner and the database, so someone finished ours and
        another party prepared the gid again in between (any role may; gids are public). That
        one is not ours to finish, and refusing to must not stop the scan. And when another
        session is finishing it right now (55000, "is busy": a relay past the hard limit, or
        another resolver): if that session fails, the next scan sees the batch again.
        """
        try:
            return postgres.finish_prepared(self._session, gid, commit=commit)
        except (psycopg.errors.InsufficientPrivilege, psycopg.errors.FeatureNotSupported,
                psycopg.errors.ObjectNotInPrerequisiteState):
            return False

    @postgres.translated
    def xmin_horizon(self, prefix: str) -> dict[str, HorizonHolder]:
        return xmin_horizon(self._session, prefix)

    @postgres.translated
    def prepared_slots(self) -> tuple[int, int]:
        return prepared_slots(self._session)

    def stats_session(self) -> StatsSession:
        """A new session for the stats passes, which run on a thread of their own
        (outbox_relay/runtime/stats.py): connected like this one, not yet."""
        return StatsSession(self._url, self._table, connect_timeout=self._connect_timeout,
                            application_name="outbox-resolver stats")

    @postgres.translated
    def watch(self, prefix: str, lock_class: int) -> tuple[list[str], list[int]]:
        """The gids of ``prefix`` prepared now and the instances whose lock is held now: one
        query, shared memory only (resolver/watch.py)."""
        row = self._session.execute(self.tables.query("watch"),
                                    {"prefix": prefix + ":", "class": lock_class}).fetchone()
        assert row is not None
        prepared, live = row
        return list(prepared), list(live)
