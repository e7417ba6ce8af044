"""`outbox-relay migrate` upgrades a version 1 schema in place (issue 10): dead letters get an
id of their own (the old id kept as outbox_id), the outbox gets row_bytes, the ledger key is
created; twice in a row changes nothing; the relay and the dead-letter commands work on it.
The schema's version is recorded in the database (issue 34): `migrate --check` and both
programs refuse a schema that is missing, older, or newer than they can use; pg_dump and
pg_restore keep it."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from devenv import checker
from devenv.servers import pg_bindir
from outbox_relay.errors import StartupCheckError
from outbox_relay.schema import SCHEMA_VERSION, migrate, schema_version
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

    # A version 1 schema records no version: refused until migrated.
    checked = cli(env, "migrate", "--check")
    assert checked.returncode == 3, checked.stderr
    assert checked.stderr.strip().splitlines() == [
        f"outbox-relay: error: table {env.table!r} records no outbox-relay schema version (made "
        "by outbox-relay 0.1.0, or its comment was changed): run `outbox-relay migrate`"]
    assert checked.stdout == ""

    migrate(env.db_url, env.table)
    migrate(env.db_url, env.table)  # idempotent
    checked = cli(env, "migrate", "--check")
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.strip() == (f"outbox-relay: table {env.table!r} has schema version "
                                      f"{SCHEMA_VERSION} (current)")

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


def recorded(env: Env) -> str | None:
    with env.connect() as conn:
        row = conn.execute("SELECT obj_description(to_regclass(%s), 'pg_class')",
                           (Tables(env.table).outbox.as_string(None),)).fetchone()
    assert row is not None
    return None if row[0] is None else str(row[0])


def set_recorded(env: Env, comment: str) -> None:
    with env.connect() as conn:
        conn.execute(sql.SQL("COMMENT ON TABLE {} IS {}").format(
            Tables(env.table).outbox, sql.Literal(comment)))


def only_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def test_a_missing_schema_fails_the_check_with_one_line(env: Env) -> None:
    checked = cli(env, "migrate", "--check", "--table", "never_migrated")
    assert checked.returncode == 3
    assert only_line(checked.stderr) == (
        "outbox-relay: error: table 'never_migrated' or 'never_migrated_dead_letter' does not "
        "exist: run `outbox-relay migrate` first")
    unreachable = cli(env, "migrate", "--check", "--database-url",
                      "postgresql://app:pw@127.0.0.1:9/x", "--connect-timeout", "1")
    assert unreachable.returncode == 1 and "cannot connect to PostgreSQL" in unreachable.stderr


def test_a_newer_schema_is_refused_unless_it_is_usable_and_migrate_never_downgrades_it(
        env: Env) -> None:
    newer = SCHEMA_VERSION + 1
    unusable = (f"outbox-relay schema version {newer}, usable by programs of schema version "
                f"{newer} or newer; written by outbox-relay migrate")
    set_recorded(env, unusable)
    refusal = (f"table {env.table!r} has schema version {newer}, usable by programs of schema "
               f"version {newer} or newer; this outbox-relay's is {SCHEMA_VERSION}: upgrade "
               "outbox-relay")
    checked = cli(env, "migrate", "--check")
    assert checked.returncode == 3 and only_line(checked.stderr) == f"outbox-relay: error: {refusal}"
    for program, args in (("relay", ()), ("resolver", ("--once",))):
        done = subprocess.run([sys.executable, "-m", f"outbox_relay.{program}", *args],
                              env=env.cli_env(), capture_output=True, text=True, timeout=60,
                              cwd=ROOT, check=False)
        assert done.returncode == 3, (program, done.stderr)
        [line] = [line for line in done.stderr.splitlines() if "startup_check_failed" in line]
        assert refusal in line, done.stderr
    # An older migrate (this one, against a newer schema) changes nothing, and says why.
    applied = cli(env, "migrate")
    assert applied.returncode == 3
    assert f"has a newer schema than version {SCHEMA_VERSION}" in only_line(applied.stderr), \
        applied.stderr
    with pytest.raises(StartupCheckError, match="not changed; use a newer outbox-relay"):
        migrate(env.db_url, env.table)
    assert recorded(env) == unusable

    # A newer schema that says this program's version can use it (an additive change): the
    # check passes and the relay runs on it.
    set_recorded(env, unusable.replace(f"version {newer} or newer", f"version {SCHEMA_VERSION} "
                                       "or newer"))
    checked = cli(env, "migrate", "--check")
    assert checked.returncode == 0, checked.stderr
    assert f"(newer than this outbox-relay's {SCHEMA_VERSION}, and usable by it)" in checked.stdout
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 10, exchange=env.exchange,
                                         routing_key=env.routing_key)
    relay = env.spawn("relay")
    wait_until(lambda: outbox_count(env) == 0, 60, "the relay to run on the newer schema")
    assert stop(relay) == 0
    assert env.drain_and_check(produced).ok()


def test_pg_dump_and_restore_keep_the_schema_version(env: Env) -> None:
    """The version is a comment on the outbox table: a schema-only dump of the three tables,
    restored into another database, says its version there, and the relay's check passes."""
    # The client programs of the PostgreSQL the tests run (OUTBOX_TEST_PG): Debian's pg_dump 15
    # refuses a newer server. A server given by OUTBOX_TEST_DATABASE_URL: the ones on PATH.
    bindir = None if os.environ.get("OUTBOX_TEST_DATABASE_URL") else pg_bindir()
    pg_dump, psql = ((str(bindir / "pg_dump"), str(bindir / "psql")) if bindir
                     else (shutil.which("pg_dump"), shutil.which("psql")))
    assert pg_dump and psql, "pg_dump and psql: Debian's postgresql-client"
    tables = Tables(env.table)
    dumped = subprocess.run([pg_dump, "--schema-only", "--no-owner", *(
        f"--table={name}" for name in (tables.name, tables.dead_letter_name,
                                       tables.ledger_key_name)), env.db_url],
        capture_output=True, text=True, timeout=60, check=True).stdout
    assert "COMMENT ON TABLE" in dumped
    database = f"restored_{secrets.token_hex(4)}"
    with env.connect() as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    try:
        other_url = make_conninfo(env.db_url, dbname=database)
        restored = subprocess.run([psql, other_url, "-X", "-q", "-v", "ON_ERROR_STOP=1"],
                                  input=dumped, capture_output=True, text=True, timeout=60)
        assert restored.returncode == 0, restored.stderr
        with psycopg.connect(other_url, autocommit=True) as conn:
            found = schema_version(conn, tables)
        assert (found.version, found.problem) == (SCHEMA_VERSION, None)
    finally:
        with env.connect() as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(database)))
