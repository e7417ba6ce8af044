"""The resolver's VACUUM metrics on a real PostgreSQL: what holds back the xmin horizon, and whether
it is one of our prepared batches."""

from __future__ import annotations

import time

import pytest
from psycopg import sql

from outbox_relay.gid import Gid, lock_class
from outbox_relay.resolver.metrics import ResolverMetrics
from outbox_relay.resolver.worker import Resolver
from outbox_relay.tables import Tables
from tests.conftest import Env

INSTANCE = 0x5EED


def test_resolver_says_whether_our_prepared_batch_holds_back_vacuum(env: Env) -> None:
    metrics = ResolverMetrics()
    resolver = Resolver(env.resolver_settings(hard_limit=3600), metrics=metrics)
    gid = str(Gid(env.gid_prefix, INSTANCE, 1))

    def sample(name: str, **labels: str) -> float:
        value = metrics.registry.get_sample_value(name, labels)
        assert value is not None, name
        return value

    def holder_age(holder: str) -> float:
        return sample("outbox_xmin_horizon_age_transactions", holder=holder)

    # (A batch left prepared by a failed assertion is rolled back by the env fixture.)
    with env.connect() as relay, env.connect() as reader, env.connect() as other:
        # A live relay: its instance lock is held, so the resolver leaves its batch alone.
        relay.execute("SELECT pg_advisory_lock(%s, %s)", (lock_class(env.gid_prefix), INSTANCE))
        # A snapshot older than our batch: a REPEATABLE READ transaction, then another
        # transaction takes an xid so that ours comes strictly later.
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute("SELECT 1")
        other.execute("SELECT txid_current()")
        relay.execute("BEGIN")
        relay.execute(sql.SQL("INSERT INTO {} (routing_key, payload) VALUES ('k', '{{}}')")
                      .format(Tables(env.table).outbox))
        relay.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        time.sleep(1.1)

        assert resolver.resolve_once() == {}
        assert sample("outbox_prepared_transactions") == 1
        assert holder_age("session") > holder_age("outbox_prepared") >= 1
        assert sample("outbox_session_transaction_age_seconds") >= 1.0  # the reader's
        # Something older than our batch holds the horizon: not ours to report.
        assert sample("outbox_prepared_holding_vacuum_age_seconds") == 0

        reader.execute("COMMIT")
        resolver.resolve_once()
        assert sample("outbox_session_transaction_age_seconds") < 1.0
        assert holder_age("outbox_prepared") >= holder_age("session")
        assert holder_age("outbox_prepared") >= holder_age("other_prepared")
        held = sample("outbox_prepared_holding_vacuum_age_seconds")
        assert held == pytest.approx(sample("outbox_prepared_oldest_age_seconds"), abs=0.5)
        assert held >= 1.0

        relay.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        resolver.resolve_once()
        assert holder_age("outbox_prepared") == 0
        assert sample("outbox_prepared_holding_vacuum_age_seconds") == 0
    resolver.close()
