"""docs/managed-postgresql.md's procedure on a real server. A managed PostgreSQL (RDS, Aurora,
Cloud SQL, Azure) gives no superuser, only an admin role with CREATEROLE and CREATEDB
(rds_superuser, cloudsqlsuperuser and azure_pg_admin are such roles, with more). As such a role:
migrate, then sql/roles.sql, which makes the admin a member of <roles>_migrate before handing it
the tables (ALTER TABLE ... OWNER TO needs that of a non-superuser); the relay and the resolver
then work as <roles>_relay through a crashed batch. And who may grant the standby wait's pg_read_all_stats."""

from __future__ import annotations

import dataclasses
import secrets
import signal
import subprocess
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from devenv import checker, launch
from tests.conftest import ROOT, Env
from tests.integration.test_pipeline import in_doubt, log_of, outbox_count, stop, wait_until
from tests.integration.test_roles import psql, with_user

ROLES_SQL = ROOT / "sql" / "roles.sql"
KINDS = ("migrate", "relay", "operator", "producer", "service")


@dataclasses.dataclass
class Managed:
    env: Env  # its table in the admin's schema; db_url: the admin's
    su: Env  # the same, as the server's superuser (for the checks)
    admin: str  # the admin role's name
    prefix: str  # of the roles sql/roles.sql creates
    password: str

    def url(self, role: str) -> str:
        return with_user(self.env.db_url, role, self.password)

    def roles_sql(self) -> subprocess.CompletedProcess[str]:
        return psql(self.env.db_url, "-v", f"table={self.env.table}", "-v",
                    f"roles={self.prefix}", "-f", str(ROLES_SQL))


@pytest.fixture
def managed(env: Env) -> Iterator[Managed]:
    uid = env.gid_prefix
    admin, schema, password = f"admin_{uid}", f"app_{uid}", secrets.token_hex(8)
    with env.connect() as su:
        su.execute(sql.SQL("CREATE ROLE {} LOGIN CREATEROLE CREATEDB PASSWORD {}").format(
            sql.Identifier(admin), sql.Literal(password)))
        su.execute(sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(
            sql.Identifier(schema), sql.Identifier(admin)))
    su = dataclasses.replace(env, table=f"{schema}.outbox")
    m = Managed(dataclasses.replace(su, db_url=with_user(env.db_url, admin, password)), su,
                admin, f"m{uid}", password)
    try:
        yield m
    finally:
        with env.connect() as su:
            for gid in in_doubt(env):
                su.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
            su.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
            for role in (*(f"{m.prefix}_{kind}" for kind in KINDS), admin):
                if su.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone():
                    su.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                    su.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_roles_sql_as_a_managed_admin_then_both_programs_as_the_relay_role(
        managed: Managed) -> None:
    m, env = managed, managed.env
    migrated = subprocess.run(launch.command("relay", "migrate"), env=env.cli_env(),
                              capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert migrated.returncode == 0, migrated.stderr

    # No superuser: handing the tables to <roles>_migrate needs membership in it (15: "must be
    # member of role", 16 and later: "must be able to SET ROLE"); roles.sql grants it to the
    # admin itself, which created the role (CREATEROLE: ADMIN on it).
    applied = m.roles_sql()
    assert applied.returncode == 0, applied.stderr
    assert m.roles_sql().returncode == 0  # again: idempotent, the membership kept
    with psycopg.connect(env.db_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
            sql.Identifier(f"{m.prefix}_service"), sql.Identifier(f"{m.prefix}_producer")))
        for kind in ("relay", "service"):
            admin.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                sql.Identifier(f"{m.prefix}_{kind}"), sql.Literal(m.password)))
        owners = admin.execute("SELECT DISTINCT tableowner FROM pg_tables WHERE schemaname = %s",
                               (env.table.split(".")[0],)).fetchall()
    assert owners == [(f"{m.prefix}_migrate",)]

    with psycopg.connect(m.url(f"{m.prefix}_service"), autocommit=True) as service:
        produced = checker.insert_events(service, env.table, 200, exchange=env.exchange,
                                         routing_key=env.routing_key)
    relay_env = dataclasses.replace(env, db_url=m.url(f"{m.prefix}_relay"))
    crashed = relay_env.spawn("relay", OUTBOX_TEST_CRASH_AT="after_ledger",
                              OUTBOX_BATCH_SIZE="50")
    assert crashed.wait(60) == -signal.SIGKILL, log_of(crashed)
    assert len(in_doubt(env)) == 1
    resolver = relay_env.spawn("resolver")
    wait_until(lambda: not in_doubt(env), 30, "the resolver to finish the crashed batch")
    relay = relay_env.spawn("relay")
    wait_until(lambda: outbox_count(relay_env) == 0, 60, "the relay to empty the outbox")
    assert stop(relay) == 0, log_of(relay)
    assert stop(resolver) == 0, log_of(resolver)
    report = m.su.drain_and_check(produced)
    assert report.ok(max_duplicates=50), report.summary()


def test_who_may_grant_the_standby_waits_pg_read_all_stats(managed: Managed) -> None:
    """OUTBOX_STANDBY_WAIT needs pg_read_all_stats (or pg_monitor) for the relay role. Up to
    PostgreSQL 15 a CREATEROLE admin may grant it; from 16 only one holding it WITH ADMIN
    OPTION may."""
    m = managed
    role = sql.Identifier(f"{m.prefix}_relay")
    with psycopg.connect(m.env.db_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(role))
        version = admin.info.server_version
        try:
            admin.execute(sql.SQL("GRANT pg_read_all_stats TO {}").format(role))
            granted = True
        except psycopg.errors.InsufficientPrivilege as exc:
            granted = False
            assert 'ADMIN option on role "pg_read_all_stats"' in str(exc), exc
    assert granted == (version < 160000), version
    with m.su.connect() as su:
        su.execute(sql.SQL("GRANT pg_read_all_stats TO {} WITH ADMIN OPTION").format(
            sql.Identifier(m.admin)))
    with psycopg.connect(m.env.db_url, autocommit=True) as admin:
        admin.execute(sql.SQL("GRANT pg_read_all_stats TO {}").format(role))


def test_the_standby_wait_without_pg_read_all_stats_stops_the_relay_at_start(
        managed: Managed) -> None:
    """Without pg_read_all_stats the relay would not see the standby's position: every batch
    would wait its timeout and roll back, publishing nothing. It says so at start instead."""
    env = managed.env
    migrated = subprocess.run(launch.command("relay", "migrate"), env=env.cli_env(),
                              capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert migrated.returncode == 0, migrated.stderr
    done = subprocess.run(launch.command("relay"), env=env.cli_env(OUTBOX_STANDBY_WAIT="any"),
                          capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert done.returncode == 3, done.stderr
    assert ("OUTBOX_STANDBY_WAIT is set but this role may not read the standbys' positions in "
            "pg_stat_replication") in done.stderr, done.stderr
