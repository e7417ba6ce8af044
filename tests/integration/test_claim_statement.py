"""The claim is prepared once per claim session (relay/store.py, CLAIM_STATEMENT): DDL on the
outbox while a relay runs must not stop it. A new column only has the plan rebuilt; a new type
for a column the claim returns fails the next claim ("cached plan must not change result
type"), and the relay must start a new session, prepare the claim again and go on, losing and
repeating nothing (the claim failed before its PREPARE TRANSACTION: nothing was published)."""

from __future__ import annotations

import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from devenv import checker
from outbox_relay.prepared import PreparedStatement
from outbox_relay.relay import store
from outbox_relay.tables import Tables
from tests.conftest import Env
from tests.integration.test_pipeline import log_of, outbox_count, stop, wait_until

pytestmark = pytest.mark.core  # run on every tested PostgreSQL (CONTRIBUTING.md)

WAVE = 500


def _wave(env: Env, number: int) -> list[str]:
    with env.connect() as conn:
        return checker.insert_events(conn, env.table, WAVE, exchange=env.exchange,
                                     routing_key=env.routing_key, start=number * WAVE,
                                     per_transaction=50)


def test_the_relay_goes_on_after_ddl_changes_the_outbox_under_its_prepared_claim(
        env: Env) -> None:
    outbox = Tables(env.table).outbox
    produced = _wave(env, 0)
    relay = env.spawn("relay", OUTBOX_BATCH_SIZE="50")
    wait_until(lambda: outbox_count(env) == 0, 60, "the first wave to be relayed")

    with env.connect() as admin:  # the plan is rebuilt, the result is the same
        admin.execute(sql.SQL("ALTER TABLE {} ADD COLUMN note text").format(outbox))
    produced += _wave(env, 1)
    wait_until(lambda: outbox_count(env) == 0, 60, "the wave after ADD COLUMN")
    assert "claim_failed" not in log_of(relay) and "ERROR" not in log_of(relay), log_of(relay)

    with env.connect() as admin:  # a column the claim returns changes type
        admin.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN attempts TYPE bigint"
                              ).format(outbox))
    produced += _wave(env, 2)
    wait_until(lambda: outbox_count(env) == 0, 60, "the wave after ALTER COLUMN ... TYPE")

    assert stop(relay) == 0, log_of(relay)
    assert "cached plan must not change result type" in log_of(relay), log_of(relay)
    report = env.drain_and_check(produced)
    assert report.ok(max_duplicates=0), report.summary()


def test_a_session_that_has_a_statement_of_the_claims_name_gets_the_claim(env: Env) -> None:
    """PgBouncer in session mode with an empty server_reset_query hands a server connection
    on as it was: a relay's new session may find an older session's statement there."""
    tables = Tables(env.table)
    with env.connect() as conn:
        conn.execute(sql.SQL("PREPARE {} AS SELECT 1").format(
            sql.Identifier(store.CLAIM_STATEMENT)))
        claim = PreparedStatement(store.CLAIM_STATEMENT, tables.query("claim"))
        claim.prepare(store.claim_session(conn))
        with conn.transaction(force_rollback=True):
            rows = conn.execute(claim.execute_query({
                "limit": 10, "max_bytes": 1 << 20, "max_message_bytes": 1 << 20,
                "max_row_bytes": 2 << 20, "one_row_at_least": True, "after": 0, "floor": 0,
                "held": Jsonb({})})).fetchall()
        assert rows == []  # the claim's result, not SELECT 1's
        statements = conn.execute("SELECT name, statement FROM pg_prepared_statements"
                                  ).fetchall()
        assert [name for name, _ in statements] == [store.CLAIM_STATEMENT]
        assert "Step 1 of the protocol" in statements[0][1]
