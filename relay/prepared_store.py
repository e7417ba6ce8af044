"""The resolver's PostgreSQL session: prepared transactions, instance locks, COMMIT/ROLLBACK
PREPARED, and what the metrics read. psycopg's errors stop at this edge (relay.store.translate)."""

from __future__ import annotations

from typing import Any

import psycopg

from relay import store
from relay.model import HorizonHolder, PreparedXact, SessionRole
from relay.queries import Tables


class PostgresPreparedStore:
    """One autocommit session of the resolver (the ``PreparedStore`` of resolver/worker.py)."""

    def __init__(self, url: str, table: str, *, connect_timeout: float) -> None:
        self._url = url
        self._connect_timeout = connect_timeout
        self.tables = Tables(table)
        self._conn: psycopg.Connection[Any] | None = None
        self._standbys_checked = False
        self.ledger_key = b""  # read on connect
        self.role = SessionRole("", superuser=False)

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed and not self._conn.broken

    @store.translated
    def connect(self) -> None:
        """Connect, fail fast on 2PC off or a missing schema, read the ledger key and our role."""
        self.close()
        conn = store.connect(self._url, timeout=self._connect_timeout,
                             application_name="outbox-resolver")
        try:
            store.check_server(conn)
            if not self._standbys_checked:  # once per process, not at every reconnect
                store.warn_unchecked(store.check_standbys(self._url, conn, self._connect_timeout))
                self._standbys_checked = True
            self.ledger_key, _database = store.read_ledger_key(conn, self.tables)
            self.role = store.session_role(conn)
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
        return store.usable(self._conn)

    @store.translated
    def prepared(self, prefix: str) -> list[PreparedXact]:
        """This database's prepared transactions of ``prefix``, oldest first."""
        return store.prepared_of_prefix(self._session, prefix)

    @store.translated
    def try_instance_lock(self, lock_class: int, instance: int) -> bool:
        return store.try_instance_lock(self._session, lock_class, instance)

    @store.translated
    def instance_unlock(self, lock_class: int, instance: int) -> None:
        store.instance_unlock(self._session, lock_class, instance)

    @store.translated
    def finish(self, gid: str, *, commit: bool) -> bool:
        return store.finish_prepared(self._session, gid, commit=commit)

    @store.translated
    def xmin_horizon(self, prefix: str) -> dict[str, HorizonHolder]:
        return store.xmin_horizon(self._session, prefix)

    @store.translated
    def outbox_stats(self) -> tuple[int, float]:
        return store.outbox_stats(self._session, self.tables)

    @store.translated
    def blocked_keys(self) -> int:
        return store.blocked_keys(self._session, self.tables)

    @store.translated
    def watch(self, prefix: str, lock_class: int) -> tuple[list[str], list[int]]:
        """The gids of ``prefix`` prepared now and the instances whose lock is held now: one
        query, shared memory only (resolver/watch.py)."""
        row = self._session.execute(self.tables.query("watch"),
                                    {"prefix": prefix + ":", "class": lock_class}).fetchone()
        assert row is not None
        prepared, live = row
        return list(prepared), list(live)
