"""Least privilege, for real: sql/roles.sql applied with psql, then migrate, a producer, the relay,
the resolver (a decision included) and the dead-letter command each run as the role docs/operations.md
gives it, with RabbitMQ users limited to the documented permissions. And what does not work: a
resolver logged in as another role cannot finish the relays' batches (PostgreSQL allows COMMIT
PREPARED only to the preparing role or a superuser), so it says so and leaves them alone."""

from __future__ import annotations

import json
import logging
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator

import psycopg
import psycopg.errors
import pytest
from psycopg import sql

from devenv import checker, launch
from devenv.servers import PostgresServer, RabbitServer
from outbox_relay.resolver.metrics import ResolverMetrics
from outbox_relay.resolver.worker import Resolver
from outbox_relay.schema import SCHEMA_VERSION
from outbox_relay.tables import Tables
from tests.conftest import ROOT, Env, External, finish_env, make_env, server_url
from tests.integration.test_pipeline import in_doubt, log_of, outbox_count, stop, wait_until

ROLES_SQL = ROOT / "sql" / "roles.sql"


def with_user(url: str, user: str, password: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{user}:{password}@{rest.rsplit('@', 1)[1]}"


@pytest.fixture(scope="module")
def rabbit(rabbit_server: RabbitServer | External) -> Iterator[RabbitServer]:
    """A node whose users the test may manage: the session's own, or one of this module's."""
    if isinstance(rabbit_server, RabbitServer):
        yield rabbit_server
        return
    with RabbitServer() as own:
        yield own


@pytest.fixture
def renv(pg_server: PostgresServer | External, rabbit: RabbitServer) -> Iterator[Env]:
    e = make_env(server_url(pg_server), rabbit.url, tag="g")
    yield e
    finish_env(e)


def psql(url: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("psql")
    assert binary, "psql not found: install Debian's postgresql-client (./dev installs postgresql)"
    return subprocess.run([binary, url, "-X", "-q", *args], capture_output=True, text=True,
                          timeout=60, check=False, input=stdin)


def printed_roles() -> str:
    """sql/roles.sql as the installed package prints it (`outbox-relay migrate --print-roles`)."""
    printed = subprocess.run(launch.command("relay", "migrate", "--print-roles"), cwd=ROOT,
                             env={"PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                             timeout=60, check=False)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == ROLES_SQL.read_text("utf-8")
    return printed.stdout


@pytest.fixture
def roles(renv: Env) -> Iterator[dict[str, str]]:
    """The roles of `outbox-relay migrate --print-roles | psql -f -` for this test's table (the
    first time), of sql/roles.sql (again: idempotent); {role kind: PostgreSQL URL as that role}."""
    prefix = f"r{renv.gid_prefix}"
    result = psql(renv.db_url, "-v", f"table={renv.table}", "-v", f"roles={prefix}",
                  "-f", "-", stdin=printed_roles())
    assert result.returncode == 0, result.stderr
    again = psql(renv.db_url, "-v", f"table={renv.table}", "-v", f"roles={prefix}",
                 "-f", str(ROLES_SQL))
    assert again.returncode == 0, again.stderr  # idempotent
    urls = {}
    with renv.connect() as admin:
        # The service: a role of its own that is granted the producer role.
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
            sql.Identifier(f"{prefix}_service"), sql.Identifier(f"{prefix}_producer")))
        for kind in ("migrate", "relay", "operator", "service"):
            password = secrets.token_hex(8)  # the server may check passwords, or trust
            admin.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                sql.Identifier(f"{prefix}_{kind}"), sql.Literal(password)))
            urls[kind] = with_user(renv.db_url, f"{prefix}_{kind}", password)
    try:
        yield urls
    finally:
        with renv.connect() as admin:
            for gid in in_doubt(renv):  # prepared as a role that is about to go
                admin.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
            for kind in ("migrate", "relay", "operator", "producer", "service"):
                role = sql.Identifier(f"{prefix}_{kind}")
                admin.execute(sql.SQL("REASSIGN OWNED BY {} TO CURRENT_USER").format(role))
                admin.execute(sql.SQL("DROP OWNED BY {}").format(role))
                admin.execute(sql.SQL("DROP ROLE {}").format(role))


@pytest.fixture
def amqp_users(renv: Env, rabbit: RabbitServer) -> Iterator[dict[str, str]]:
    """RabbitMQ users with docs/operations.md's permissions; {program: AMQP URL as that user}."""
    ledger, exchange = re.escape(renv.ledger_stream), re.escape(renv.exchange)
    # The ledger is a stream and an exchange of the same name: declaring both and binding them
    # takes configure on the name, write on the stream and read on the exchange; records go
    # through that exchange (write). No one needs the default exchange.
    permissions = {  # configure, write, read
        "relay": (f"^{ledger}$", rf"^({ledger}|{exchange})$", f"^{ledger}$"),
        "resolver": (f"^{ledger}$", f"^{ledger}$", f"^{ledger}$"),
    }
    urls = {}
    for program, (configure, write, read) in permissions.items():
        user, password = f"{renv.gid_prefix}-{program}", secrets.token_hex(8)
        rabbit.ctl("add_user", user, password)
        rabbit.ctl("set_permissions", "-p", "/", user, configure, write, read)
        urls[program] = with_user(rabbit.url, user, password)
    try:
        yield urls
    finally:
        for program in permissions:
            rabbit.ctl("delete_user", f"{renv.gid_prefix}-{program}")


def run_cli(env: Env, program: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(launch.command(program, *args),
                          env=env.cli_env(**extra),
                          capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)


def may_maintain(env: Env) -> bool:
    """PostgreSQL 17 and later: roles.sql grants the relays' role MAINTAIN on the outbox."""
    with env.connect() as conn:
        row = conn.execute("SELECT current_setting('server_version_num')::int").fetchone()
    return row is not None and row[0] >= 170000


def refused(url: str, statement: sql.Composable) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        try:
            conn.execute(statement)
        except psycopg.errors.InsufficientPrivilege:
            return True
    return False


def clustered_indexes(env: Env) -> list[str]:
    with psycopg.connect(env.db_url, autocommit=True) as conn:
        return [name for (name,) in conn.execute(
            "SELECT i.relname FROM pg_index AS x JOIN pg_class AS i ON i.oid = x.indexrelid "
            "WHERE x.indrelid = %s::regclass AND x.indisclustered",
            (env.table,)).fetchall()]


def test_each_program_works_as_its_least_privileged_role(
        renv: Env, roles: dict[str, str], amqp_users: dict[str, str]) -> None:
    env = renv
    tables = Tables(env.table)
    relay_env = {"OUTBOX_DATABASE_URL": roles["relay"], "OUTBOX_AMQP_URL": amqp_users["relay"],
                 "OUTBOX_BATCH_SIZE": "20", "OUTBOX_MAX_ATTEMPTS": "2",
                 "OUTBOX_MAX_MESSAGE_BYTES": str(1 << 20)}
    resolver_env = {"OUTBOX_DATABASE_URL": roles["relay"],
                    "OUTBOX_AMQP_URL": amqp_users["resolver"]}

    # The migrate role owns the tables now: it applies the schema (idempotent) on its own.
    migrated = run_cli(env, "relay", "migrate", OUTBOX_DATABASE_URL=roles["migrate"])
    assert migrated.returncode == 0, migrated.stderr
    # It may compact the outbox; the relays' role may only from PostgreSQL 17 on, with the
    # MAINTAIN roles.sql grants it there (before: PostgreSQL would only warn; exit 3).
    compacted = run_cli(env, "relay", "compact", OUTBOX_DATABASE_URL=roles["migrate"])
    assert compacted.returncode == 0, compacted.stderr
    assert clustered_indexes(env) == []  # the owner put CLUSTER's mark back: none
    relay_compact = run_cli(env, "relay", "compact", OUTBOX_DATABASE_URL=roles["relay"])
    if may_maintain(env):
        assert relay_compact.returncode == 0, relay_compact.stderr
        # MAINTAIN may not ALTER the table: the primary key stays marked (operations.md).
        assert clustered_indexes(env) == [f"{env.table}_pkey"]
    else:
        assert relay_compact.returncode == 3, relay_compact.stderr
        assert "may not rewrite" in relay_compact.stderr
    # Every role reads the schema's version without a grant of its own (an init container).
    for kind in ("relay", "operator", "service"):
        checked = run_cli(env, "relay", "migrate", "--check", OUTBOX_DATABASE_URL=roles[kind])
        assert checked.returncode == 0, (kind, checked.stderr)
        assert f"schema version {SCHEMA_VERSION} (current)" in checked.stdout

    # The service inserts events with nothing but its producer grant.
    # An exchange that exists but the relay's user may not write to.
    conn, channel = env.amqp_channel()
    channel.exchange_declare(env.exchange + ".forbidden", exchange_type="topic")
    conn.close()
    with psycopg.connect(roles["service"], autocommit=True) as service:
        produced = checker.insert_events(service, env.table, 100, exchange=env.exchange,
                                         routing_key=env.routing_key)
        # The AMQP type and correlation id are producer columns, and go to the dead-letter
        # table with the row.
        service.execute(sql.SQL("INSERT INTO {} (message_id, exchange, routing_key, payload, "
                                "headers, message_type, correlation_id) VALUES "
                                "('bad-headers', %s, 'k', '{{}}', '[1]', 't.v1', 'req-1'), "
                                "('no-exchange', %s, 'k', '{{}}', '{{}}', NULL, NULL), "
                                "('forbidden', %s, 'k', '{{}}', '{{}}', NULL, NULL)").format(
                                    tables.outbox),
                        (env.exchange, env.exchange + ".missing", env.exchange + ".forbidden"))
        # Too big to fetch: the claim itself moves it to the dead-letter table.
        service.execute(sql.SQL("INSERT INTO {} (message_id, exchange, routing_key, payload_bytes)"
                                " VALUES ('too-big', %s, 'k', %s)").format(tables.outbox),
                        (env.exchange, b"\0" * (3 << 20)))

    # A relay dies after the ledger record of its first batch ...
    crashed = env.spawn("relay", OUTBOX_TEST_CRASH_AT="after_ledger", **relay_env)
    assert crashed.wait(60) == -signal.SIGKILL, log_of(crashed)
    (gid,) = in_doubt(env)

    # ... a resolver logged in as another role cannot even read the ledger key: exit 3 ...
    other = run_cli(env, "resolver", "--once", OUTBOX_LOG_FORMAT="json",
                    OUTBOX_DATABASE_URL=roles["operator"], OUTBOX_AMQP_URL=amqp_users["resolver"])
    assert other.returncode == 3, other.stderr
    assert "permission denied reading" in other.stderr, other.stderr
    # ... and, allowed to read it, still may not finish the batch: it says so and leaves it ...
    with env.connect() as admin:
        admin.execute(sql.SQL("GRANT SELECT ON {} TO {}").format(
            tables.ledger_key, sql.Identifier(f"r{env.gid_prefix}_operator")))
    other = run_cli(env, "resolver", "--once", OUTBOX_LOG_FORMAT="json",
                    OUTBOX_DATABASE_URL=roles["operator"], OUTBOX_AMQP_URL=amqp_users["resolver"])
    with env.connect() as admin:
        admin.execute(sql.SQL("REVOKE SELECT ON {} FROM {}").format(
            tables.ledger_key, sql.Identifier(f"r{env.gid_prefix}_operator")))
    assert other.returncode == 0, other.stderr
    lines = [json.loads(line) for line in other.stderr.splitlines()]
    (warning,) = [line for line in lines if line["action"] == "not_owner"]
    assert warning["gid"] == gid and warning["owner"] == f"r{env.gid_prefix}_relay"
    assert in_doubt(env) == [gid]

    # ... and the resolver as the relays' role commits it (its ledger record is there).
    resolver = run_cli(env, "resolver", "--once", **resolver_env)
    assert resolver.returncode == 0, resolver.stderr
    assert "in-doubt batch committed" in resolver.stderr, resolver.stderr
    assert in_doubt(env) == []

    # The relay publishes the rest, retries and dead-letters the three bad rows.
    relay = env.spawn("relay", **relay_env)
    wait_until(lambda: outbox_count(env) == 0, 60, "the relay to empty the outbox")
    assert stop(relay) == 0, log_of(relay)
    for text in (log_of(relay), log_of(crashed)):
        assert "permission denied" not in text, text  # PostgreSQL's refusal
        # With these roles nobody but the relays' role (and the migrate role, the key's owner)
        # reads the ledger key: the start-up check says nothing.
        assert "ledger_key_readable" not in text, text

    # The operator lists and requeues dead letters.
    listed = run_cli(env, "relay", "dead-letter", "list", "--json",
                     OUTBOX_DATABASE_URL=roles["operator"])
    assert listed.returncode == 0, listed.stderr
    rows = {row["message_id"]: row for row in json.loads(listed.stdout)}
    dead = {message_id: row["id"] for message_id, row in rows.items()}
    assert set(dead) == {"bad-headers", "no-exchange", "forbidden", "too-big"}
    with env.connect() as admin:
        kept = admin.execute(sql.SQL("SELECT message_type, correlation_id FROM {} WHERE "
                                     "message_id = 'bad-headers'").format(
                                         tables.dead_letter)).fetchone()
    assert kept == ("t.v1", "req-1")
    # A publish without write permission closes the channel; retried alone, the row is named.
    assert "ACCESS_REFUSED" in rows["forbidden"]["last_error"], rows["forbidden"]
    requeued = run_cli(env, "relay", "dead-letter", "requeue", "--id", str(dead["no-exchange"]),
                       OUTBOX_DATABASE_URL=roles["operator"])
    assert requeued.returncode == 0, requeued.stderr
    assert "requeued 1 dead letter" in requeued.stdout
    assert outbox_count(env) == 1

    deliveries = checker.drain(env.amqp_url, env.queue, expected=set(produced))
    with env.connect() as admin:
        # The poison rows are not among the produced events: out of the count.
        admin.execute(sql.SQL("DELETE FROM {}").format(tables.outbox))
        admin.execute(sql.SQL("DELETE FROM {}").format(tables.dead_letter))
        report = checker.check(produced, deliveries, conn=admin, table=env.table,
                               gid_prefix=env.gid_prefix)
    # The batch whose channel the broker closed may have delivered rows it did not confirm.
    assert report.ok(max_duplicates=20), report.summary()

    # Least: each role is refused what it does not need.
    for kind, statement in (
        ("relay", sql.SQL("SELECT * FROM {}").format(tables.dead_letter)),
        ("relay", sql.SQL("INSERT INTO {} (routing_key, payload) VALUES ('k', '{{}}')")
         .format(tables.outbox)),
        ("operator", sql.SQL("DELETE FROM {}").format(tables.outbox)),
        ("service", sql.SQL("SELECT * FROM {}").format(tables.outbox)),
        ("service", sql.SQL("DELETE FROM {}").format(tables.outbox)),
        # The ledger key is the relays' alone; the relay's own columns are not the producer's.
        ("service", sql.SQL("SELECT key FROM {}").format(tables.ledger_key)),
        ("operator", sql.SQL("SELECT key FROM {}").format(tables.ledger_key)),
        ("service", sql.SQL("INSERT INTO {} (routing_key, payload, created_at) "
                            "VALUES ('k', '{{}}', 'infinity')").format(tables.outbox)),
        ("service", sql.SQL("INSERT INTO {} (routing_key, payload, attempts) "
                            "VALUES ('k', '{{}}', -1)").format(tables.outbox)),
        ("service", sql.SQL("INSERT INTO {} (id, routing_key, payload) OVERRIDING SYSTEM VALUE "
                            "VALUES (1, 'k', '{{}}')").format(tables.outbox)),
        # The relay changes a row's attempts, available_at and last_error, nothing else ...
        ("relay", sql.SQL("UPDATE {} SET payload = '{{}}'").format(tables.outbox)),
        ("relay", sql.SQL("UPDATE {} SET ordering_key = 'k', routing_key = 'k'")
         .format(tables.outbox)),
        # ... and writes a dead letter's columns but its own id and time.
        ("relay", sql.SQL("INSERT INTO {} (id, message_id, exchange, routing_key, headers, "
                          "created_at, attempts, last_error) VALUES (1, 'm', '', 'k', '{{}}', "
                          "now(), 1, 'e')").format(tables.dead_letter)),
        ("relay", sql.SQL("UPDATE {} SET last_error = 'e'").format(tables.dead_letter)),
        # The operator fixes a dead letter's message, never its identity or its record.
        ("operator", sql.SQL("UPDATE {} SET outbox_id = 1").format(tables.dead_letter)),
        ("operator", sql.SQL("UPDATE {} SET message_id = 'm'").format(tables.dead_letter)),
        ("operator", sql.SQL("UPDATE {} SET attempts = 0, last_error = ''")
         .format(tables.dead_letter)),
    ):
        assert refused(roles[kind], statement), f"{kind} may {statement.as_string(None)}"
    with psycopg.connect(roles["operator"]) as operator:  # rolled back on exit
        operator.execute(sql.SQL("UPDATE {} SET exchange = exchange, routing_key = routing_key, "
                                 "payload = payload, headers = headers").format(
                                     tables.dead_letter))


def test_roles_sql_refuses_to_run_before_migrate(renv: Env) -> None:
    result = psql(renv.db_url, "-v", "table=never_migrated", "-v", f"roles=r{renv.gid_prefix}",
                  "-f", str(ROLES_SQL))
    assert result.returncode != 0
    assert "run `outbox-relay migrate` first" in result.stderr
    with renv.connect() as admin:
        row = admin.execute("SELECT count(*) FROM pg_roles WHERE starts_with(rolname, %s)",
                            (f"r{renv.gid_prefix}_",)).fetchone()
    assert row == (0,)


def public_may_create(url: str) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT EXISTS (SELECT FROM pg_namespace AS n, aclexplode(n.nspacl) AS a"
                           " WHERE n.nspname = 'public' AND a.grantee = 0"
                           " AND a.privilege_type = 'CREATE')").fetchone()
    return bool(row and row[0])


def test_roles_sql_takes_back_what_it_does_not_grant(renv: Env, roles: dict[str, str]) -> None:
    """A run after an upgrade: the relay's table-wide UPDATE of an older roles.sql and PUBLIC's
    CREATE on public (PostgreSQL 13 and 14) are taken back; roles.sql itself, run as a
    superuser, calls no function a producer planted in public."""
    env, tables = renv, Tables(renv.table)
    prefix = f"r{env.gid_prefix}"
    apply = ["-v", f"table={env.table}", "-v", f"roles={prefix}", "-f", str(ROLES_SQL)]
    with env.connect() as admin:
        admin.execute(sql.SQL("GRANT UPDATE ON {} TO {}").format(
            tables.outbox, sql.Identifier(f"{prefix}_relay")))
        admin.execute("GRANT CREATE ON SCHEMA public TO PUBLIC")
        admin.execute(sql.SQL("CREATE TABLE {} (who text)").format(sql.Identifier(f"{prefix}_hits")))
        admin.execute(sql.SQL("GRANT INSERT ON {} TO PUBLIC").format(
            sql.Identifier(f"{prefix}_hits")))
    try:
        with psycopg.connect(roles["service"], autocommit=True) as producer:
            # A better match than pg_catalog's format(text, VARIADIC "any") for roles.sql's calls.
            producer.execute(sql.SQL(
                "CREATE FUNCTION public.format(text, text, text) RETURNS text LANGUAGE sql AS "
                "$$ INSERT INTO public.{} VALUES (current_user); "
                "SELECT pg_catalog.format($1, $2, $3) $$").format(sql.Identifier(f"{prefix}_hits")))
        with env.connect() as admin:  # the look-alike is real: an unpinned session calls it
            admin.execute("SELECT format('%I.%I', 'a'::text, 'b'::text)")
            assert admin.execute(sql.SQL("DELETE FROM {} RETURNING 1").format(
                sql.Identifier(f"{prefix}_hits"))).fetchall() == [(1,)]
        assert not refused(roles["relay"], sql.SQL("UPDATE {} SET payload = '{{}}'").format(
            tables.outbox))

        kept = psql(env.db_url, "-v", "public_create=keep", *apply)
        assert kept.returncode == 0, kept.stderr
        assert refused(roles["relay"], sql.SQL("UPDATE {} SET payload = '{{}}'").format(
            tables.outbox))
        assert public_may_create(env.db_url)
        wrong = psql(env.db_url, "-v", "public_create=maybe", *apply)
        assert wrong.returncode != 0 and "public_create must be revoke or keep" in wrong.stderr

        revoked = psql(env.db_url, *apply)
        assert revoked.returncode == 0, revoked.stderr
        assert not public_may_create(env.db_url)
        with env.connect() as admin:
            row = admin.execute(sql.SQL("SELECT count(*) FROM {}").format(
                sql.Identifier(f"{prefix}_hits"))).fetchone()
        assert row == (0,)
    finally:
        with env.connect() as admin:
            admin.execute("DROP FUNCTION IF EXISTS public.format(text, text, text)")
            admin.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(f"{prefix}_hits")))
            admin.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")


def test_the_resolver_as_the_relays_role_compacts_after_a_hold_only_where_it_may(
        renv: Env, roles: dict[str, str], amqp_users: dict[str, str],
        caplog: pytest.LogCaptureFixture) -> None:
    """The resolver's compaction after a held snapshot (resolver/compaction.py) as the relays'
    role: before PostgreSQL 17 it does not own the table, so it is counted and logged once,
    nothing tried; from 17 on, roles.sql's MAINTAIN lets it compact. The hold is another
    role's, whose xact_start this role cannot see: timed by the scans."""
    metrics = ResolverMetrics()
    resolver = Resolver(renv.resolver_settings(
        database_url=roles["relay"], amqp_url=amqp_users["resolver"], compact_after_hold=0.3,
        compact_above=0.001, hard_limit=3600), metrics=metrics, background_stats=False)

    def scan() -> None:
        resolver.stats.next_at = 0.0
        resolver.resolve_once()

    try:
        with renv.connect() as holder:
            holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT 1")
            scan()  # the scans time it: another role's xact_start is hidden from this one
            time.sleep(0.4)
            scan()
            # OutboxVacuumHeldBySession's gauge sees it too (it read 0 for another role's session).
            age = metrics.registry.get_sample_value("outbox_session_transaction_age_seconds")
            assert age is not None and age >= 0.4
            holder.execute("COMMIT")
        with caplog.at_level(logging.INFO, logger="resolver"):
            scan()
            scan()
    finally:
        resolver.close()

    def count(outcome: str) -> float | None:
        return metrics.registry.get_sample_value("outbox_resolver_compactions_total",
                                                 {"outcome": outcome})

    said = [r for r in caplog.records if getattr(r, "action", "").startswith("compact")]
    if may_maintain(renv):
        assert (count("compacted"), count("not_allowed")) == (1, 0)
        assert [r.action for r in said] == ["compacted"]  # type: ignore[attr-defined]
    else:
        assert (count("compacted"), count("not_allowed")) == (0, 1)
        assert [r.action for r in said] == ["compact_not_allowed"]  # type: ignore[attr-defined]
        assert "may not rewrite" in said[0].getMessage()
