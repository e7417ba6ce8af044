"""`outbox-relay migrate` upgrades a version 1 schema in place (issue 10): dead letters get an
id of their own (the old id kept as outbox_id), the outbox gets row_bytes, the ledger key is
created; twice in a row changes nothing; the relay and the dead-letter commands work on it."""

from __future__ import annotations

import json
import subprocess
import sys

from psycopg import sql

from devenv import checker
from outbox_relay.schema import migrate
from outbox_relay.tables import Tables
from tests.conftest import ROOT, Env
from tests.integration.test_pipeline import outbox_count, stop, wait_until

# The schema as version 1 created it (sql/schema.sql before issue 10).
V1 = """
CREATE TABLE {outbox} (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id    text NOT NULL DEFAULT gen_random_uuid()::text,
    exchange      text NOT NULL DEFAULT '',
    routing_key   text NOT NULL,
    ordering_key  text,
    payload       jsonb,
    payload_bytes bytea,
    headers       jsonb NOT NULL DEFAULT '{{}}'::jsonb,
    content_type  text,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    available_at  timestamptz NOT NULL DEFAULT now(),
    attempts      integer NOT NULL DEFAULT 0,
    last_error    text,
    CHECK (num_nonnulls(payload, payload_bytes) = 1)
);
CREATE UNIQUE INDEX {message_id_index} ON {outbox} (message_id);
CREATE INDEX {retry_index} ON {outbox} (available_at) WHERE attempts > 0;
CREATE TABLE {dead_letter} (
    id            bigint PRIMARY KEY,
    message_id    text NOT NULL,
    exchange      text NOT NULL,
    routing_key   text NOT NULL,
    ordering_key  text,
    payload       jsonb,
    payload_bytes bytea,
    headers       jsonb NOT NULL,
    content_type  text,
    created_at    timestamptz NOT NULL,
    attempts      integer NOT NULL,
    last_error    text NOT NULL,
    dead_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""


def cli(env: Env, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "outbox_relay.relay", *args], env=env.cli_env(),
                          capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)


def test_a_version_1_schema_is_upgraded_in_place(env: Env) -> None:
    tables = Tables(env.table)
    with env.connect() as conn:
        conn.execute(sql.SQL("DROP TABLE {}, {}, {}").format(
            tables.outbox, tables.dead_letter, tables.ledger_key))
        conn.execute(tables.compose(V1))
        produced = checker.insert_events(conn, env.table, 50, exchange=env.exchange,
                                         routing_key=env.routing_key)
        # Dead letters of version 1: their id was the outbox id, 3 is the highest.
        conn.execute(sql.SQL(
            "INSERT INTO {} (id, message_id, exchange, routing_key, headers, payload, created_at,"
            " attempts, last_error) VALUES (2, 'old-2', %s, 'k', '{{}}', '{{}}', now(), 3, 'x'),"
            " (3, 'old-3', %s, 'k', '{{}}', '{{}}', now(), 3, 'x')").format(tables.dead_letter),
            (env.exchange, env.exchange))

    migrate(env.db_url, env.table)
    migrate(env.db_url, env.table)  # idempotent

    with env.connect() as conn:
        old = conn.execute(sql.SQL("SELECT id, outbox_id FROM {} ORDER BY id").format(
            tables.dead_letter)).fetchall()
        assert old == [(2, 2), (3, 3)]
        sizes = conn.execute(sql.SQL("SELECT min(row_bytes) FROM {}").format(
            tables.outbox)).fetchone()
        assert sizes is not None and sizes[0] > 200  # computed for the rows already there
    relay = env.spawn("relay", OUTBOX_BATCH_SIZE="20")
    wait_until(lambda: outbox_count(env) == 0, 60, "the outbox to empty")
    assert stop(relay) == 0
    with env.connect() as conn:
        # A bad row whose outbox id is that of an old dead letter: stored, not dropped.
        conn.execute(sql.SQL("INSERT INTO {} (id, message_id, exchange, routing_key, payload,"
                             " headers) OVERRIDING SYSTEM VALUE VALUES"
                             " (3, 'new-3', %s, 'k', '{{}}', '[1]')").format(tables.outbox),
                     (env.exchange,))
    relay = env.spawn("relay", OUTBOX_BATCH_SIZE="20")
    wait_until(lambda: outbox_count(env) == 0, 60, "the bad row to be dead-lettered")
    assert stop(relay) == 0
    listed = cli(env, "dead-letter", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["message_id"]: row["id"] for row in json.loads(listed.stdout)}
    assert set(rows) == {"old-2", "old-3", "new-3"}
    assert rows["new-3"] > 3  # numbered after the highest id there was
    requeued = cli(env, "dead-letter", "requeue", "--id", str(rows["old-2"]))
    assert requeued.returncode == 0 and "requeued 1 dead letter" in requeued.stdout
    relay = env.spawn("relay", OUTBOX_BATCH_SIZE="20")
    wait_until(lambda: outbox_count(env) == 0, 60, "the requeued row to go out")
    assert stop(relay) == 0
    report = env.drain_and_check([*produced, "old-2"])
    assert report.ok(dead_letter_expected={"old-3", "new-3"}), report.summary()
