"""A producer that may CREATE in schema public (every role may, on PostgreSQL 13 and 14 as
they ship) plants look-alikes of the functions and operators the programs call: public.mod
(numeric, bigint), an operator <= (numeric, integer), power, format, convert_to, make_interval,
pg_advisory_lock. PostgreSQL picks the best match among every schema on the search_path, so
with the default path these beat pg_catalog's (which need a cast) and run as the caller's
role. The suite's server is PostgreSQL 15: the test's own database grants CREATE on public
to PUBLIC again, as 13 and 14 do.

The attack is shown to work on a session with the default search_path; then the relay, the
resolver, `migrate` and `dead-letter list` run as sql/roles.sql's roles through a batch of
normal, oversized, unpublishable and retried rows and a crash, and the inbox's statements run
on a service's session: no look-alike is ever called by them, every event is delivered, and
both programs warn once that PUBLIC may create in the outbox's schema.
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
from collections.abc import Iterator
from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from devenv import checker, launch
from devenv.servers import PostgresServer, RabbitServer
from outbox_relay.inbox import Inbox, InboxMessage
from outbox_relay.schema import migrate
from outbox_relay.tables import Tables
from tests.conftest import ROOT, Env, External, finish_env, make_env, server_url
from tests.integration.test_pipeline import in_doubt, log_of, outbox_count, stop, wait_until
from tests.integration.test_roles import ROLES_SQL, psql, with_user

# Each look-alike notes who called it, from which program (application_name), then does what
# the real one does, so a session that calls it still works and only the note tells.
LOOK_ALIKES = """
CREATE FUNCTION public.mod(numeric, bigint) RETURNS numeric LANGUAGE sql AS $$
    INSERT INTO public.hits VALUES (current_user, current_setting('application_name'), 'mod');
    SELECT pg_catalog.mod($1, $2::numeric) $$;
CREATE FUNCTION public.budget_le(numeric, integer) RETURNS boolean LANGUAGE sql AS $$
    INSERT INTO public.hits VALUES (current_user, current_setting('application_name'), '<=');
    SELECT $1 OPERATOR(pg_catalog.<=) $2::numeric $$;
CREATE OPERATOR public.<= (LEFTARG = numeric, RIGHTARG = integer, FUNCTION = public.budget_le);
CREATE FUNCTION public.power(integer, integer) RETURNS double precision LANGUAGE sql AS $$
    INSERT INTO public.hits VALUES (current_user, current_setting('application_name'), 'power');
    SELECT pg_catalog.power($1::float8, $2::float8) $$;
CREATE FUNCTION public.format(text, integer, integer) RETURNS text LANGUAGE sql AS $$
    INSERT INTO public.hits VALUES (current_user, current_setting('application_name'), 'format');
    SELECT pg_catalog.format($1, $2, $3) $$;
CREATE FUNCTION public.format(text, bigint, integer) RETURNS text LANGUAGE sql AS $$
    INSERT INTO public.hits VALUES (current_user, current_setting('application_name'), 'format');
    SELECT pg_catalog.format($1, $2, $3) $$;
CREATE FUNCTION public.convert_to(text, text) RETURNS bytea LANGUAGE sql AS $$
    INSERT INTO public.hits VALUES (current_user, current_setting('application_name'),
                                    'convert_to');
    SELECT pg_catalog.convert_to($1, $2::name) $$;
CREATE FUNCTION public.make_interval(secs double precision) RETURNS interval LANGUAGE sql AS $$
    INSERT INTO public.hits VALUES (current_user, current_setting('application_name'),
                                    'make_interval');
    SELECT pg_catalog.make_interval(secs => $1) $$;
CREATE FUNCTION public.pg_advisory_lock(integer) RETURNS void LANGUAGE sql AS $$
    INSERT INTO public.hits VALUES (current_user, current_setting('application_name'),
                                    'pg_advisory_lock');
    SELECT pg_catalog.pg_advisory_lock($1::bigint) $$;
CREATE FUNCTION public.pg_advisory_xact_lock(integer) RETURNS void LANGUAGE sql AS $$
    INSERT INTO public.hits VALUES (current_user, current_setting('application_name'),
                                    'pg_advisory_xact_lock');
    SELECT pg_catalog.pg_advisory_xact_lock($1::bigint) $$;
"""


def database_url(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


@pytest.fixture
def hostile(pg_server: PostgresServer | External,
            rabbit_server: RabbitServer | External) -> Iterator[tuple[Env, dict[str, str]]]:
    """A database of its own where PUBLIC may create in public, the outbox in it, sql/roles.sql's
    roles, and a producer's look-alikes; {role kind: URL as that role}."""
    base = server_url(pg_server)
    name = f"searchpath_{secrets.token_hex(4)}"
    with psycopg.connect(base, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    env = make_env(database_url(base, name), server_url(rabbit_server), tag="sp")
    prefix = f"r{env.gid_prefix}"
    kinds = ("migrate", "relay", "operator", "service")
    try:
        applied = psql(env.db_url, "-v", f"table={env.table}", "-v", f"roles={prefix}",
                       "-f", str(ROLES_SQL))
        assert applied.returncode == 0, applied.stderr
        urls = {}
        with env.connect() as admin:
            # As PostgreSQL 13 and 14 ship (and a deployment that ran an older roles.sql).
            admin.execute("GRANT CREATE ON SCHEMA public TO PUBLIC")
            admin.execute("CREATE TABLE public.hits (who name, program text, what text)")
            admin.execute("GRANT INSERT ON public.hits TO PUBLIC")
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                sql.Identifier(f"{prefix}_service"), sql.Identifier(f"{prefix}_producer")))
            for kind in kinds:
                password = secrets.token_hex(8)
                admin.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                    sql.Identifier(f"{prefix}_{kind}"), sql.Literal(password)))
                urls[kind] = with_user(env.db_url, f"{prefix}_{kind}", password)
        # The producer plants its look-alikes: nothing but the default grant lets it.
        with psycopg.connect(urls["service"], autocommit=True) as producer:
            producer.execute(LOOK_ALIKES)
        yield env, urls
    finally:
        finish_env(env)
        with psycopg.connect(base, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))
            for kind in (*kinds, "producer"):
                admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(
                    sql.Identifier(f"{prefix}_{kind}")))


def hits(env: Env) -> list[tuple[str, str, str]]:
    """(role, program, look-alike) of every call of a look-alike so far."""
    with env.connect() as conn:
        return [tuple(row) for row in conn.execute(  # type: ignore[misc]
            "SELECT who::text, program, what FROM public.hits ORDER BY 1, 2, 3").fetchall()]


def run_cli(env: Env, program: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(launch.command(program, *args), env=env.cli_env(**extra),
                          capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)


def insert(env: Env, message_id: str, **columns: Any) -> str:
    columns = {"message_id": message_id, "exchange": env.exchange, "routing_key": "k",
               **columns}
    names = sql.SQL(", ").join(sql.Identifier(c) for c in columns)
    values = sql.SQL(", ").join(sql.Placeholder() for _ in columns)
    with env.connect() as conn:
        conn.execute(sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
            Tables(env.table).outbox, names, values), list(columns.values()))
    return message_id


def test_a_producers_look_alikes_never_run_in_the_programs(
        hostile: tuple[Env, dict[str, str]]) -> None:
    env, urls = hostile
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 200, exchange=env.exchange,
                                         routing_key=env.routing_key)
    # Rows that take every other path of the claim and the bookkeeping: one too big to fetch
    # (the claim's format), one refused before publishing (headers), one whose exchange does
    # not exist (retried with backoff: make_interval, power; then dead-lettered).
    bad = [insert(env, "too-big", payload_bytes=b"\0" * (2 << 20)),
           insert(env, "bad-headers", payload=Jsonb({}), headers=Jsonb([1])),
           insert(env, "no-exchange", payload=Jsonb({}), exchange=env.exchange + ".missing")]

    # The attack works on a session with the default search_path: the public.mod (as
    # the relay's role), and the byte budget's <= (numeric, integer) inside the claim itself
    # (here as a superuser, on a decoy table: a claim rolled back would take its note along).
    with psycopg.connect(urls["relay"], autocommit=True,
                         application_name="unpinned") as plain:
        assert plain.execute("SELECT mod(7::numeric, 4294967296)").fetchone() == (Decimal(7),)
    decoy = f"{env.table}_decoy"
    migrate(env.db_url, decoy)
    with env.connect() as admin:
        checker.insert_events(admin, decoy, 20, exchange=env.exchange, routing_key="k")
        admin.execute("SET application_name = unpinned")
        superuser = admin.execute("SELECT current_user::text").fetchone()[0]  # type: ignore[index]
        assert len(admin.execute(Tables(decoy).query("claim"), {
            "limit": 10, "max_bytes": 1 << 24, "max_message_bytes": 1 << 16,
            "max_row_bytes": (1 << 16) + (1 << 20), "one_row_at_least": True,
            "after": 0, "floor": 0, "held": Jsonb({})}).fetchall()) == 10
        admin.execute(sql.SQL("DROP TABLE {}, {}, {}").format(
            Tables(decoy).outbox, Tables(decoy).dead_letter, Tables(decoy).ledger_key))
    assert {(who, what) for who, program, what in hits(env)} == {
        (f"r{env.gid_prefix}_relay", "mod"), (superuser, "<=")}, hits(env)
    with env.connect() as conn:
        conn.execute("TRUNCATE public.hits")

    settings = {"OUTBOX_DATABASE_URL": urls["relay"], "OUTBOX_LOG_FORMAT": "json",
                "OUTBOX_BATCH_SIZE": "50", "OUTBOX_MAX_ATTEMPTS": "2",
                "OUTBOX_MAX_MESSAGE_BYTES": str(1 << 16)}
    # A relay dies holding a prepared batch; the resolver finds it and rolls it back.
    crashed = env.spawn("relay", OUTBOX_TEST_CRASH_AT="after_prepare", **settings)
    assert crashed.wait(60) == -signal.SIGKILL, log_of(crashed)
    assert len(in_doubt(env)) == 1
    resolver = run_cli(env, "resolver", "--once", **settings)
    assert resolver.returncode == 0, resolver.stderr
    assert in_doubt(env) == []
    relay = env.spawn("relay", **settings)
    wait_until(lambda: outbox_count(env) == 0, 60, "the relay to empty the outbox")
    assert stop(relay) == 0, log_of(relay)
    migrated = run_cli(env, "relay", "migrate", OUTBOX_DATABASE_URL=urls["migrate"])
    assert migrated.returncode == 0, migrated.stderr
    listed = run_cli(env, "relay", "dead-letter", "list", "--json",
                     OUTBOX_DATABASE_URL=urls["operator"])
    assert listed.returncode == 0, listed.stderr
    assert sorted(row["message_id"] for row in json.loads(listed.stdout)) == sorted(bad)

    # The inbox runs on the service's own session, search_path untouched: its statements
    # call pg_catalog's functions by name.
    inbox = Inbox(f"inbox_{env.gid_prefix}", consumer="c", check_order=True,
                  relay_users=["relay"])
    with env.connect() as admin:
        inbox.migrate(admin)
        for table in (inbox.table, f"{inbox.table}_keys"):
            admin.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {}").format(
                sql.Identifier(table), sql.Identifier(f"r{env.gid_prefix}_service")))
    with psycopg.connect(urls["service"], application_name="service") as service:
        message = InboxMessage("m-1", b"{}", {"x-ordering-key": "k", "x-outbox-id": 1},
                               user_id="relay")
        assert inbox.record(service, message).name == "APPLIED"
        service.commit()
        service.autocommit = True
        assert inbox.prune(service, older_than=3600) == 0

    assert hits(env) == []
    # Both programs say once that PUBLIC may create in the outbox's schema.
    for text in (log_of(crashed), log_of(relay), resolver.stderr):
        warnings = [line for line in map(json.loads, text.splitlines())
                    if line.get("action") == "schema_create_open"]
        assert len(warnings) == 1, text
        assert warnings[0]["message"].startswith("PUBLIC may CREATE in schema 'public'")

    deliveries = checker.drain(env.amqp_url, env.queue, expected=set(produced))
    with env.connect() as conn:
        conn.execute(sql.SQL("DELETE FROM {}").format(Tables(env.table).dead_letter))
        report = checker.check(produced, deliveries, conn=conn, table=env.table,
                               gid_prefix=env.gid_prefix)
    assert report.ok(max_duplicates=50), report.summary()


def test_pg_catalog_open_to_create_stops_both_programs(
        hostile: tuple[Env, dict[str, str]]) -> None:
    """The pin protects only while no one but a superuser may create in pg_catalog."""
    env, urls = hostile
    with env.connect() as admin:
        admin.execute("GRANT CREATE ON SCHEMA pg_catalog TO PUBLIC")
    try:
        for program in ("relay", "resolver"):
            done = run_cli(env, program, *(["--once"] if program == "resolver" else []),
                           OUTBOX_DATABASE_URL=urls["relay"])
            assert done.returncode == 3, done.stderr
            (line,) = [line for line in done.stderr.splitlines() if "pg_catalog" in line]
            assert "PUBLIC may CREATE in schema pg_catalog" in line, done.stderr
            assert "startup_check_failed" in line
    finally:
        with env.connect() as admin:
            admin.execute("REVOKE CREATE ON SCHEMA pg_catalog FROM PUBLIC")
