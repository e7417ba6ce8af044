"""The resolver decides in-doubt batches oldest first, a bounded window per ledger read, and
asks the ledger only about the window's gids, each with its own xid and database (no servers)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from relay import ledger, store
from relay.config import ResolverSettings
from relay.gid import Gid
from relay.model import PreparedXact
from resolver import worker
from resolver.worker import Resolver

T0 = datetime(2024, 1, 1, tzinfo=timezone.utc)


def xact(n: int) -> PreparedXact:
    gid = str(Gid("outbox", 0x100 + n, 1))
    return PreparedXact(gid, T0 + timedelta(seconds=n), "relay", 1000.0 - n, xid=5000 + n,
                        database="app")


def test_candidates_are_decided_oldest_first_in_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    prepared = [xact(n) for n in range(600)]
    reads: list[tuple[datetime, dict[str, ledger.Expected]]] = []
    finished: list[tuple[str, bool]] = []
    monkeypatch.setattr(store, "prepared_of_prefix", lambda _c, _p: list(prepared))
    monkeypatch.setattr(store, "xmin_horizon", lambda _c, _p: {})
    monkeypatch.setattr(store, "outbox_stats", lambda _c, _t: (0, 0.0))
    monkeypatch.setattr(store, "try_instance_lock", lambda _c, _k, _i: True)
    monkeypatch.setattr(store, "instance_unlock", lambda _c, _k, _i: None)
    monkeypatch.setattr(store, "finish_prepared",
                        lambda _c, gid, *, commit: finished.append((gid, commit)) or True)
    resolver = Resolver(ResolverSettings(database_url="postgresql://x@h/db",
                                         amqp_url="amqp://x@h/%2F", ledger_margin=60))
    resolver._role = store.SessionRole("relay", superuser=False)
    monkeypatch.setattr(resolver, "_db", lambda: None)

    def read(since: datetime, candidates: dict[str, ledger.Expected]) -> dict[str, Any]:
        reads.append((since, candidates))
        first = next(iter(candidates))
        return {first: 1}  # the oldest of each window is in the ledger

    monkeypatch.setattr(resolver, "_ledger_gids", read)

    outcomes = resolver.resolve_once()

    sizes = [len(candidates) for _since, candidates in reads]
    assert sizes == [worker.LEDGER_WINDOW, worker.LEDGER_WINDOW, 600 - 2 * worker.LEDGER_WINDOW]
    assert [since for since, _c in reads] == [
        T0 + timedelta(seconds=n - 60) for n in (0, worker.LEDGER_WINDOW, 2 * worker.LEDGER_WINDOW)]
    assert reads[0][1][prepared[3].gid] == ledger.Expected(5003, "app")
    assert [gid for gid, _commit in finished] == [x.gid for x in prepared]  # oldest first
    assert sum(commit for _gid, commit in finished) == 3
    assert len(outcomes) == 600
