"""Prepared transactions no relay made never stop the resolver (issue 32, item 2).

Any PostgreSQL role may PREPARE a transaction under any gid once max_prepared_transactions > 0,
one shaped like ours included: ``BEGIN; PREPARE TRANSACTION 'outbox:ffffffff:1'`` made the
resolver exit on every scan (``pg_try_advisory_lock(integer, bigint) does not exist``), and no
relay's batch in doubt was decided meanwhile. The resolver leaves every such transaction
alone, counts it (``outbox_resolver_foreign_prepared_transactions``), logs it once
(``foreign_prepared``) and decides the relays' batches as if it were not there. The attacks
are devenv/hostile.py's, which the chaos run can share.
"""

from __future__ import annotations

import json
import re
import secrets
import signal
import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from devenv import checker
from devenv.hostile import foreign_gids, prepare_foreign
from devenv.servers import free_port
from outbox_relay.resolver.store import PostgresPreparedStore
from outbox_relay.tables import Tables
from tests.acceptance.test_metrics import scrape
from tests.conftest import Env
from tests.integration.test_ledger_trust import (
    BATCH,
    actions,
    finish_and_check,
    resolve_once,
    unpublished_in_doubt_batch,
)
from tests.integration.test_pipeline import log_of, outbox_count, stop, wait_until
from tests.integration.test_roles import with_user


@pytest.fixture
def stranger(env: Env) -> Iterator[str]:
    """The URL of a LOGIN role with no grant at all: any role of the cluster."""
    role, password = f"stranger_{env.gid_prefix}", secrets.token_hex(8)
    with env.connect() as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
            sql.Identifier(role), sql.Literal(password)))
    try:
        yield with_user(env.db_url, role, password)
    finally:
        with env.connect() as conn:
            roll_back(conn, owner=role)
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def roll_back(conn: psycopg.Connection[object], *, owner: str) -> None:
    """Finish by hand (as a superuser) what ``owner`` prepared in this database."""
    for (gid,) in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE owner = %s"
                               " AND database = current_database()", (owner,)).fetchall():
        conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))


def role_of(url: str) -> str:
    return url.split("://", 1)[1].split(":", 1)[0]


def prepared_here(env: Env) -> set[str]:
    """This database's prepared transactions of the test's prefix."""
    with env.connect() as conn:
        rows = conn.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
                            " AND starts_with(gid, %s)", (env.gid_prefix + ":",)).fetchall()
    return {row[0] for row in rows}


@pytest.mark.parametrize("kind", sorted(foreign_gids("p")))
def test_a_foreign_gid_of_our_prefix_never_stops_the_scan(env: Env, stranger: str,
                                                          kind: str) -> None:
    gid, produced = unpublished_in_doubt_batch(env)
    foreign = foreign_gids(env.gid_prefix)[kind]
    prepare_foreign(stranger, foreign)

    code, lines = resolve_once(env)

    assert code == 0, lines
    assert [line["gid"] for line in actions(lines, "resolved_rolled_back")] == [gid]
    (warning,) = actions(lines, "foreign_prepared")
    assert (warning["gid"], warning["reason"]) == (foreign, "gid"), warning
    assert prepared_here(env) == {foreign}  # left alone
    with env.connect() as conn:
        roll_back(conn, owner=role_of(stranger))
    finish_and_check(env, produced)


def test_a_relay_shaped_gid_prepared_by_another_role_is_left_alone(env: Env,
                                                                   stranger: str) -> None:
    """A gid a relay could have made, its instance lock free, prepared by a role that cannot
    read the ledger key: no relay's. A superuser resolver (the tests' servers) rolled it back."""
    gid, produced = unpublished_in_doubt_batch(env)
    foreign = f"{env.gid_prefix}:00000abc:1"
    prepare_foreign(stranger, foreign)

    code, lines = resolve_once(env)

    assert code == 0, lines
    assert [line["gid"] for line in actions(lines, "resolved_rolled_back")] == [gid]
    (warning,) = actions(lines, "foreign_prepared")
    assert (warning["gid"], warning["reason"], warning["owner"]) == (
        foreign, "owner", role_of(stranger)), warning
    assert prepared_here(env) == {foreign}
    with env.connect() as conn:
        roll_back(conn, owner=role_of(stranger))
    finish_and_check(env, produced)


def test_another_databases_prepared_transactions_are_not_looked_at(env: Env) -> None:
    """Gids of our prefix in another database (another service's outbox with the same prefix,
    or a hostile role's; that database is LATIN1, so one gid is not even valid UTF-8 here): the
    resolver lists only its own database's transactions. It could not finish another
    database's anyway ("prepared transaction belongs to another database")."""
    other = f"other_{env.gid_prefix}"
    other_url = make_conninfo(env.db_url, dbname=other)
    latin1_url = make_conninfo(other_url, client_encoding="LATIN1")
    relay_shaped, latin1 = f"{env.gid_prefix}:00000abc:1", f"{env.gid_prefix}:0000000\xe9:1"
    with env.connect() as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} ENCODING 'LATIN1' TEMPLATE template0"
                             " LC_COLLATE 'C' LC_CTYPE 'C'").format(sql.Identifier(other)))
    try:
        prepare_foreign(other_url, relay_shaped)
        prepare_foreign(latin1_url, latin1)
        gid, produced = unpublished_in_doubt_batch_here(env)

        code, lines = resolve_once(env)

        assert code == 0, lines
        assert [line["gid"] for line in actions(lines, "resolved_rolled_back")] == [gid]
        assert not actions(lines, "foreign_prepared")
    finally:
        with psycopg.connect(latin1_url, autocommit=True) as conn:
            for name in (relay_shaped, latin1):
                conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(name)))
        with env.connect() as conn:
            conn.execute(sql.SQL("DROP DATABASE {}").format(sql.Identifier(other)))
    finish_and_check(env, produced)


def unpublished_in_doubt_batch_here(env: Env) -> tuple[str, list[str]]:
    """unpublished_in_doubt_batch, reading this database's gids only: test_pipeline.in_doubt
    reads every database's (and could not decode another database's LATIN1 gid)."""
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 100, exchange=env.exchange,
                                         routing_key=env.routing_key, keys=100)
    doomed = env.spawn("relay", OUTBOX_BATCH_SIZE=str(BATCH), OUTBOX_TEST_CRASH_AT="after_prepare")
    wait_until(lambda: doomed.poll() is not None, 60, "the crash after PREPARE")
    (gid,) = prepared_here(env)
    return gid, produced


def test_finishing_a_gid_prepared_again_by_another_party_is_gone_not_an_error(
        env: Env, stranger: str) -> None:
    """Between a scan and its COMMIT/ROLLBACK PREPARED, the relay's batch may be finished by
    someone else and its gid prepared again by another role or in another database (gids are
    public). PostgreSQL then refuses (42501, 0A000); the store reports the batch as gone, as
    for 42704, and the foreign transaction stays prepared."""
    tables = Tables(env.table)
    role, password = f"relayish_{env.gid_prefix}", secrets.token_hex(8)
    other = f"other_{env.gid_prefix}"
    other_url = make_conninfo(env.db_url, dbname=other)
    with env.connect() as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
            sql.Identifier(role), sql.Literal(password)))
        conn.execute(sql.SQL("GRANT SELECT ON {} TO {}").format(tables.ledger_key,
                                                                 sql.Identifier(role)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(other)))
    by_stranger, elsewhere = f"{env.gid_prefix}:00000abc:1", f"{env.gid_prefix}:00000abd:1"
    relayish = PostgresPreparedStore(with_user(env.db_url, role, password), env.table,
                                     connect_timeout=5)
    superuser = PostgresPreparedStore(env.db_url, env.table, connect_timeout=5)
    try:
        prepare_foreign(stranger, by_stranger)
        prepare_foreign(other_url, elsewhere)
        relayish.connect()
        superuser.connect()

        assert relayish.finish(by_stranger, commit=False) is False  # 42501
        assert superuser.finish(elsewhere, commit=True) is False  # 0A000
        assert relayish.connected and superuser.connected

        assert prepared_here(env) == {by_stranger}
    finally:
        relayish.close()
        superuser.close()
        with psycopg.connect(other_url, autocommit=True) as conn:
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(elsewhere)))
        with env.connect() as conn:
            conn.execute(sql.SQL("DROP DATABASE {}").format(sql.Identifier(other)))
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_a_running_resolver_counts_them_says_each_once_and_is_not_woken(
        env: Env, stranger: str) -> None:
    """A resolver that runs (a scan every 600 s, a watch every 0.1 s): every foreign
    transaction is in the gauge by reason and in the log once; none wakes the watch (woken, it
    would scan every 0.1 s); a relay killed after PREPARE is still taken over at once."""
    port = free_port()
    resolver = env.spawn("resolver", OUTBOX_RESOLVER_INTERVAL="600", OUTBOX_METRICS_PORT=str(port),
                         OUTBOX_METRICS_HOST="127.0.0.1", OUTBOX_LOG_FORMAT="json")
    wait_until(lambda: "resolver_started" in log_of(resolver), 30, "the resolver to start")
    foreign = [*foreign_gids(env.gid_prefix).values(), f"{env.gid_prefix}:00000abc:1"]
    for gid in foreign:
        prepare_foreign(stranger, gid)
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 100, exchange=env.exchange,
                                         routing_key=env.routing_key, keys=100)
    doomed = env.spawn("relay", OUTBOX_BATCH_SIZE=str(BATCH), OUTBOX_TEST_CRASH_AT="after_prepare")
    assert doomed.wait(60) == -signal.SIGKILL, log_of(doomed)
    # Only the watch can start a scan within the test: the batch is decided within seconds.
    wait_until(lambda: "resolved_rolled_back" in log_of(resolver), 20, "the batch's takeover")
    assert prepared_here(env) == set(foreign)
    time.sleep(0.5)
    scans = metric(scrape(port), "outbox_resolver_scans_total")
    time.sleep(2.0)  # twenty watches: none may start a scan for a foreign transaction
    text = scrape(port)
    assert metric(text, "outbox_resolver_scans_total") == scans
    assert metric(text, 'outbox_resolver_foreign_prepared_transactions{reason="gid"}') == len(
        foreign) - 1
    assert metric(text, 'outbox_resolver_foreign_prepared_transactions{reason="owner"}') == 1
    assert stop(resolver) == 0
    lines = [json.loads(line) for line in log_of(resolver).splitlines() if line.startswith("{")]
    assert sorted(line["gid"] for line in actions(lines, "foreign_prepared")) == sorted(foreign)
    with env.connect() as conn:
        roll_back(conn, owner=role_of(stranger))
    relay = env.spawn("relay", OUTBOX_BATCH_SIZE=str(BATCH))
    wait_until(lambda: outbox_count(env) == 0, 60, "the outbox to empty")
    assert stop(relay) == 0, log_of(relay)
    report = env.drain_and_check(produced)
    assert report.ok(), report.summary()


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} not served:\n{text}"
    return float(match.group(1))


def test_the_servers_prepared_transaction_slots_are_exported(env: Env, stranger: str) -> None:
    """Any role, in any database, may take the server's prepared-transaction slots, and with
    every one taken no relay can PREPARE: the resolver exports how many are taken, whoever
    holds them (here a role with no grant, in another database), and how many there are."""
    elsewhere = make_conninfo(stranger, dbname="postgres")
    gids = [f"slot-{env.gid_prefix}-{n}" for n in range(3)]
    port = free_port()
    resolver = env.spawn("resolver", OUTBOX_RESOLVER_INTERVAL="0.2", OUTBOX_METRICS_PORT=str(port),
                         OUTBOX_METRICS_HOST="127.0.0.1")
    try:
        wait_until(lambda: "resolver_started" in log_of(resolver), 30, "the resolver to start")
        with env.connect() as conn:
            slots = int(conn.execute("SHOW max_prepared_transactions").fetchone()[0])  # type: ignore[index]
        wait_until(lambda: metric(scrape(port), "outbox_server_max_prepared_transactions") == slots,
                   10, "the slots to be exported")
        for gid in gids:
            prepare_foreign(elsewhere, gid)
        # >=: a server shared with other test runs (OUTBOX_TEST_DATABASE_URL) has theirs too.
        wait_until(lambda: metric(scrape(port), "outbox_server_prepared_transactions") >= len(gids),
                   10, "the other database's prepared transactions to be counted")
    finally:
        with psycopg.connect(make_conninfo(env.db_url, dbname="postgres"), autocommit=True) as conn:
            for gid in gids:
                if conn.execute("SELECT FROM pg_prepared_xacts WHERE gid = %s", (gid,)).fetchone():
                    conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        assert stop(resolver) == 0, log_of(resolver)
