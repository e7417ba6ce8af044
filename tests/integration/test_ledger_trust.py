"""The ledger as evidence: only records a relay wrote decide an in-doubt batch.

A forged record (a producer row, another broker user, a genuine record of another transaction)
never makes the resolver commit a batch whose messages were not published; the ledger key is
checked at start-up; a ledger deleted under running relays is declared again before anything
more is claimed; a long ledger read fails on lack of progress, not on time.
"""

from __future__ import annotations

import json
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from devenv import checker, launch
from devenv.hostile import POISONED_REJECTED_AS, append_to_ledger, poisoned_records
from devenv.memory import status_kib
from devenv.servers import PostgresServer, RabbitServer, free_port
from outbox_relay import ledger
from outbox_relay.tables import Tables
from tests.acceptance.test_metrics import scrape
from tests.conftest import ROOT, Env, External, finish_env, make_env, server_url
from tests.integration.test_hostile_rows import dead_letters, insert
from tests.integration.test_pipeline import in_doubt, log_of, outbox_count, stop, wait_until
from tests.integration.test_roles import with_user

BATCH = 20


@pytest.fixture(scope="module")
def rabbit(rabbit_server: RabbitServer | External) -> Iterator[RabbitServer]:
    """A node whose users the test may manage."""
    if isinstance(rabbit_server, RabbitServer):
        yield rabbit_server
        return
    with RabbitServer() as own:
        yield own


@pytest.fixture
def tenv(pg_server: PostgresServer | External, rabbit: RabbitServer) -> Iterator[Env]:
    e = make_env(server_url(pg_server), rabbit.url, tag="l")
    yield e
    finish_env(e)


def resolve_once(env: Env, **extra: str) -> tuple[int, list[dict[str, Any]]]:
    """``outbox-resolver --once`` with JSON logs: (exit code, log lines)."""
    done = subprocess.run([sys.executable, "-m", "outbox_relay.resolver", "--once"],
                          env=env.cli_env(OUTBOX_LOG_FORMAT="json", **extra),
                          capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    return done.returncode, lines


def actions(lines: list[dict[str, Any]], action: str) -> list[dict[str, Any]]:
    return [line for line in lines if line.get("action") == action]


def unpublished_in_doubt_batch(env: Env) -> tuple[str, list[str]]:
    """A relay killed right after PREPARE: a batch in doubt whose messages were never published.
    Committing it would lose them. Returns (its gid, every event produced)."""
    with env.connect() as conn:
        # A key per event: what the batch in doubt holds back is its own rows only (with few
        # keys, per-key order holds back their later rows too, and they fill every claim).
        produced = checker.insert_events(conn, env.table, 100, exchange=env.exchange,
                                         routing_key=env.routing_key, keys=100)
    doomed = env.spawn("relay", OUTBOX_BATCH_SIZE=str(BATCH), OUTBOX_TEST_CRASH_AT="after_prepare")
    wait_until(lambda: doomed.poll() is not None, 60, "the crash after PREPARE")
    (gid,) = in_doubt(env)
    return gid, produced


def prepared_xid(env: Env, gid: str) -> int:
    with env.connect() as conn:
        row = conn.execute("SELECT transaction::text::bigint FROM pg_prepared_xacts WHERE gid = %s",
                           (gid,)).fetchone()
    assert row is not None
    return int(row[0])


def ledger_key(env: Env) -> bytes:
    with env.connect() as conn:
        row = conn.execute(sql.SQL("SELECT key FROM {}").format(
            Tables(env.table).ledger_key)).fetchone()
    assert row is not None
    return bytes(row[0])


def finish_and_check(env: Env, produced: list[str], *, dead: int = 0,
                     max_duplicates: int = 0) -> checker.Report:
    """A healthy relay publishes what is left; nothing may be missing."""
    relay = env.spawn("relay", OUTBOX_BATCH_SIZE=str(BATCH))
    wait_until(lambda: outbox_count(env) == 0 and not in_doubt(env), 60, "the outbox to empty")
    assert stop(relay) == 0, log_of(relay)
    report = env.drain_and_check(produced)
    assert report.ok(dead_letter_expected=dead, max_duplicates=max_duplicates), report.summary()
    return report


@pytest.mark.parametrize("via", ["default_exchange", "ledger_exchange"])
def test_producer_row_forging_a_record_for_a_real_in_doubt_batch(tenv: Env, via: str) -> None:
    env = tenv
    gid, produced = unpublished_in_doubt_batch(env)
    forged = {"type": "batch", "v": 1, "gid": gid, "xid": prepared_xid(env, gid),
              "database": "outbox", "count": BATCH, "relay": gid.split(":")[1], "mac": "0" * 64}
    exchange = "" if via == "default_exchange" else env.ledger_stream
    insert(env, "forgery", exchange=exchange, routing_key=env.ledger_stream, payload=Jsonb(forged))
    # A relay handles the producer's row: dead-lettered, never published to the ledger.
    relay = env.spawn("relay", OUTBOX_BATCH_SIZE=str(BATCH))
    wait_until(lambda: "forgery" in dead_letters(env), 60, "the forged row to be dead-lettered")
    assert stop(relay) == 0, log_of(relay)
    assert dead_letters(env)["forgery"].startswith("addressed to the ledger stream")
    assert in_doubt(env) == [gid]

    code, lines = resolve_once(env)

    assert code == 0, lines
    assert [line["gid"] for line in actions(lines, "resolved_rolled_back")] == [gid]
    assert not actions(lines, "resolved_committed")
    finish_and_check(env, produced, dead=1)  # its rows went out after all: none lost


def test_records_written_by_another_broker_user_are_rejected(tenv: Env, rabbit: RabbitServer) -> None:
    env = tenv
    gid, produced = unpublished_in_doubt_batch(env)
    xid = prepared_xid(env, gid)
    user, password = f"{env.gid_prefix}-forger", secrets.token_hex(8)
    rabbit.ctl("add_user", user, password)
    ledger_re = re.escape(env.ledger_stream)
    rabbit.ctl("set_permissions", "-p", "/", user, "^$", rf"^(amq\.default|{ledger_re})$", "^$")
    try:
        conn = pika.BlockingConnection(pika.URLParameters(with_user(env.amqp_url, user, password)))
        channel = conn.channel()
        channel.confirm_delivery()
        fields = dict(gid=gid, xid=xid, database="outbox", count=BATCH, relay="x")
        # Unsigned, signed with a guessed key, and through either way into the stream.
        unsigned = json.dumps({"type": "batch", **fields}).encode()
        guessed = ledger.batch_record(b"\0" * 32, **fields)  # type: ignore[arg-type]
        channel.basic_publish("", env.ledger_stream, unsigned)
        channel.basic_publish(env.ledger_stream, env.ledger_stream, guessed)
        conn.close()
    finally:
        rabbit.ctl("delete_user", user)

    code, lines = resolve_once(env)

    assert code == 0, lines
    assert [line["gid"] for line in actions(lines, "resolved_rolled_back")] == [gid]
    rejected = actions(lines, "ledger_record_rejected")
    # The guessed key's record carries that key's id: "another key" (a forger may say so).
    assert [line["reason"] for line in rejected] == ["unauthenticated", "other_key"]
    assert all(line["gid"] == gid for line in rejected)
    finish_and_check(env, produced)


def test_genuine_record_of_another_transaction_proves_nothing(tenv: Env) -> None:
    """Signed with the real key but for another xid (an earlier transaction with the same gid):
    rejected as other_transaction; the batch is rolled back."""
    env = tenv
    gid, produced = unpublished_in_doubt_batch(env)
    key = ledger_key(env)
    xid = prepared_xid(env, gid)
    conn, channel = env.amqp_channel()
    for wrong in ({"xid": xid - 1, "database": "outbox"}, {"xid": xid, "database": "another"}):
        channel.basic_publish(env.ledger_stream, env.ledger_stream, ledger.batch_record(
            key, gid=gid, count=BATCH, relay="x", **wrong))  # type: ignore[arg-type]
    conn.close()

    code, lines = resolve_once(env)

    assert code == 0, lines
    assert [line["gid"] for line in actions(lines, "resolved_rolled_back")] == [gid]
    assert [line["reason"] for line in actions(lines, "ledger_record_rejected")] == [
        "other_transaction", "other_transaction"]
    finish_and_check(env, produced)


def test_a_relays_own_signed_record_commits(tenv: Env) -> None:
    """The control: killed after its ledger record, the batch is committed, no duplicates."""
    env = tenv
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 60, exchange=env.exchange,
                                         routing_key=env.routing_key)
    doomed = env.spawn("relay", OUTBOX_BATCH_SIZE=str(BATCH), OUTBOX_TEST_CRASH_AT="after_ledger")
    wait_until(lambda: doomed.poll() is not None, 60, "the crash after the ledger record")
    (gid,) = in_doubt(env)

    code, lines = resolve_once(env)

    assert code == 0, lines
    assert [line["gid"] for line in actions(lines, "resolved_committed")] == [gid]
    assert not actions(lines, "ledger_record_rejected")
    report = finish_and_check(env, produced)
    assert report.duplicates == 0


# -- the key at start-up ------------------------------------------------------------------------


def test_missing_ledger_key_stops_relay_and_resolver_at_start(tenv: Env) -> None:
    env = tenv
    with env.connect() as conn:
        conn.execute(sql.SQL("DROP TABLE {}").format(Tables(env.table).ledger_key))
    for program in ("relay", "resolver"):
        args = ["--once"] if program == "resolver" else []
        done = subprocess.run(launch.command(program, *args), env=env.cli_env(),
                              capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
        assert done.returncode == 3, done.stderr
        lines = [line for line in done.stderr.splitlines() if "ledger key" in line]
        assert len(lines) == 1 and "run `outbox-relay migrate`" in lines[0], done.stderr
    migrated = subprocess.run([sys.executable, "-m", "outbox_relay.relay", "migrate"], env=env.cli_env(),
                              capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert migrated.returncode == 0, migrated.stderr
    assert len(ledger_key(env)) == 32


def test_unreadable_ledger_key_stops_the_relay_at_start(tenv: Env) -> None:
    env = tenv
    tables = Tables(env.table)
    role, password = f"u{env.gid_prefix}", secrets.token_hex(8)
    with env.connect() as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
            sql.Identifier(role), sql.Literal(password)))
        conn.execute(sql.SQL("GRANT SELECT, UPDATE, DELETE ON {} TO {}").format(
            tables.outbox, sql.Identifier(role)))
        conn.execute(sql.SQL("GRANT INSERT, SELECT (ordering_key) ON {} TO {}").format(
            tables.dead_letter, sql.Identifier(role)))
    try:
        done = subprocess.run([sys.executable, "-m", "outbox_relay.relay"],
                              env=env.cli_env(OUTBOX_DATABASE_URL=with_user(env.db_url, role,
                                                                            password)),
                              capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
        assert done.returncode == 3, done.stderr
        assert "permission denied reading" in done.stderr and password not in done.stderr
    finally:
        with env.connect() as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_ledger_name_the_broker_refuses_is_a_startup_error(tenv: Env, rabbit: RabbitServer) -> None:
    env = tenv
    user, password = f"{env.gid_prefix}-nope", secrets.token_hex(8)
    rabbit.ctl("add_user", user, password)
    rabbit.ctl("set_permissions", "-p", "/", user, "^$", ".*", ".*")  # may not declare it
    try:
        for program in ("relay", "resolver"):
            done = subprocess.run(
                launch.command(program), capture_output=True, text=True, timeout=60,
                cwd=ROOT, check=False,
                env=env.cli_env(OUTBOX_AMQP_URL=with_user(env.amqp_url, user, password),
                                OUTBOX_RECONNECT_MAX_DELAY="0.5"))
            assert done.returncode == 3, done.stderr
            assert "RabbitMQ refused the ledger" in done.stderr, done.stderr
            assert password not in done.stderr
    finally:
        rabbit.ctl("delete_user", user)


# -- the ledger deleted under running relays ----------------------------------------------------


@pytest.mark.parametrize("deleted", ["stream", "exchange"])
def test_ledger_deleted_while_relays_run_is_declared_again(tenv: Env, deleted: str) -> None:
    env = tenv
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 3000, exchange=env.exchange,
                                         routing_key=env.routing_key)
    relay = env.spawn("relay", OUTBOX_BATCH_SIZE="50", OUTBOX_LOG_FORMAT="json")
    wait_until(lambda: outbox_count(env) < 2800, 60, "the relay to start moving rows")
    conn, channel = env.amqp_channel()
    if deleted == "stream":
        channel.queue_delete(env.ledger_stream)
    else:
        channel.exchange_delete(env.ledger_stream)
    conn.close()
    wait_until(lambda: outbox_count(env) == 0 and not in_doubt(env), 120, "the outbox to empty")
    assert relay.poll() is None, log_of(relay)
    assert stop(relay) == 0, log_of(relay)
    log = [json.loads(line) for line in log_of(relay).splitlines() if line.startswith("{")]
    assert actions(log, "ledger_missing"), log_of(relay)
    # Declared again: the stream and its binding exist, and records went on after the outage.
    conn, channel = env.amqp_channel()
    channel.queue_declare(env.ledger_stream, passive=True)
    channel.exchange_declare(env.ledger_stream, passive=True)
    conn.close()
    report = env.drain_and_check(produced)
    assert report.ok(max_duplicates=50), report.summary()


# -- a long ledger read ----------------------------------------------------------------------


def test_resolver_reads_a_long_ledger_on_progress_not_elapsed_time(tenv: Env) -> None:
    """100,000 records behind the in-doubt batch's record take longer to read than the read
    timeout (0.2 s): the read goes on while records keep coming, and the batch is committed."""
    env = tenv
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 40, exchange=env.exchange,
                                         routing_key=env.routing_key)
    doomed = env.spawn("relay", OUTBOX_BATCH_SIZE=str(BATCH), OUTBOX_TEST_CRASH_AT="after_ledger")
    wait_until(lambda: doomed.poll() is not None, 60, "the crash after the ledger record")
    (gid,) = in_doubt(env)
    conn, channel = env.amqp_channel()
    filler = json.dumps({"type": "batch", "gid": "other:00000000:1", "pad": "x" * 40}).encode()
    for n in range(100_000):
        channel.basic_publish(env.ledger_stream, env.ledger_stream, filler)
        if n % 5000 == 0:
            conn.process_data_events(time_limit=0)
    conn.close()

    code, lines = resolve_once(env, OUTBOX_LEDGER_READ_TIMEOUT="0.2")

    assert code == 0, lines
    assert [line["gid"] for line in actions(lines, "resolved_committed")] == [gid]
    finish_and_check(env, produced)


# -- records no check may raise on (issue 32) ----------------------------------------------------

def test_the_poisoned_record_of_issue_32_no_longer_stops_the_takeover(tenv: Env) -> None:
    """The record of the issue: a non-ASCII mac (hmac.compare_digest raised TypeError, the read
    failed, the batch stayed prepared). Appended as any user of the vhost can."""
    env = tenv
    gid, produced = unpublished_in_doubt_batch(env)
    records = poisoned_records(gid, prepared_xid(env, gid))
    append_to_ledger(env.amqp_url, env.ledger_stream, [records["non_ascii_mac"]])

    code, lines = resolve_once(env)

    assert code == 0, lines
    assert [line["gid"] for line in actions(lines, "resolved_rolled_back")] == [gid]
    (rejected,) = actions(lines, "ledger_record_rejected")
    assert (rejected["gid"], rejected["reason"]) == (gid, "unauthenticated"), rejected
    finish_and_check(env, produced)


def test_no_record_of_any_bytes_stops_the_takeover(tenv: Env) -> None:
    """Every kind of devenv.hostile.poisoned_records in the ledger at once, before a genuine
    record of another batch: each is rejected and logged once, with its reason, and both
    batches are decided (the genuine one committed)."""
    env = tenv
    gid, produced = unpublished_in_doubt_batch(env)
    records = poisoned_records(gid, prepared_xid(env, gid))
    assert set(records) == set(POISONED_REJECTED_AS)
    append_to_ledger(env.amqp_url, env.ledger_stream, records)

    code, lines = resolve_once(env)

    assert code == 0, lines
    assert [line["gid"] for line in actions(lines, "resolved_rolled_back")] == [gid]
    rejected = actions(lines, "ledger_record_rejected")
    assert sorted(line["reason"] for line in rejected) == sorted(
        POISONED_REJECTED_AS.values()), rejected
    assert all(line.get("gid") in (gid, None) for line in rejected), rejected
    assert len({line["offset"] for line in rejected}) == len(POISONED_REJECTED_AS)
    finish_and_check(env, produced)


def test_a_ledger_read_keeps_no_big_record_in_memory(tenv: Env) -> None:
    """A record of any size was parsed whole, with 1,000 in flight: 3 records of 100 MiB took a
    running resolver from 43 to 346 MiB at 7f35abe (the Kubernetes sidecar allows 128 Mi).
    pika now keeps none of a body over MAX_RECORD_BYTES: the peak stays at the baseline."""
    env = tenv
    resolver = env.spawn("resolver", OUTBOX_RESOLVER_INTERVAL="600", OUTBOX_LOG_FORMAT="json")
    wait_until(lambda: "resolver_started" in log_of(resolver), 30, "the resolver to start")
    time.sleep(1.0)  # its first scan is done
    baseline = status_kib(resolver.pid, "VmHWM")
    big = b'{"type": "batch", "gid": "x", "pad": "' + b"x" * (64 << 20) + b'"}'
    append_to_ledger(env.amqp_url, env.ledger_stream, [(big, None)] * 2)
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 100, exchange=env.exchange,
                                         routing_key=env.routing_key, keys=100)
    doomed = env.spawn("relay", OUTBOX_BATCH_SIZE=str(BATCH), OUTBOX_TEST_CRASH_AT="after_prepare")
    wait_until(lambda: doomed.poll() is not None, 60, "the crash after PREPARE")
    wait_until(lambda: "resolved_rolled_back" in log_of(resolver), 60, "the watch's takeover")
    peak = status_kib(resolver.pid, "VmHWM")
    assert stop(resolver) == 0, log_of(resolver)
    lines = [json.loads(line) for line in log_of(resolver).splitlines() if line.startswith("{")]
    assert [line["reason"] for line in actions(lines, "ledger_record_rejected")] == ["oversized"] * 2
    assert peak - baseline < 16 * 1024, (baseline, peak)  # KiB; one body would be 64 MiB
    finish_and_check(env, produced)


def test_over_10000_rejected_records_are_counted_and_logged_once(tenv: Env) -> None:
    """10,500 records that cannot be read, in the window of two takeovers by one running
    resolver: the resolver remembered 10,000 and emptied its memory, so each was logged again
    on every scan. Now: counted once, 100 lines and one summary line in all."""
    env = tenv
    port = free_port()
    # Both reads start 600 s before their batch: every junk record is in both windows.
    resolver = env.spawn("resolver", OUTBOX_RESOLVER_INTERVAL="600", OUTBOX_LOG_FORMAT="json",
                         OUTBOX_METRICS_PORT=str(port), OUTBOX_METRICS_HOST="127.0.0.1",
                         OUTBOX_LEDGER_READ_MARGIN="600")
    wait_until(lambda: "resolver_started" in log_of(resolver), 30, "the resolver to start")
    append_to_ledger(env.amqp_url, env.ledger_stream,
                     [(b"junk %d" % n, None) for n in range(10_500)])
    produced: list[str] = []
    for takeover in (1, 2):
        with env.connect() as conn:
            produced += checker.insert_events(conn, env.table, 40, exchange=env.exchange,
                                              routing_key=env.routing_key, keys=40,
                                              prefix=f"ev{takeover}")
        doomed = env.spawn("relay", OUTBOX_BATCH_SIZE=str(BATCH),
                           OUTBOX_TEST_CRASH_AT="after_prepare")
        assert doomed.wait(60) == -signal.SIGKILL, log_of(doomed)
        wait_until(lambda n=takeover: log_of(resolver).count("resolved_rolled_back") == n, 60,
                   "the watch's takeover")
    text = scrape(port)
    assert stop(resolver) == 0, log_of(resolver)
    lines = [json.loads(line) for line in log_of(resolver).splitlines() if line.startswith("{")]
    assert len(actions(lines, "ledger_record_rejected")) == 100
    (summary,) = actions(lines, "ledger_records_rejected_unlogged")
    assert summary["reasons"] == {"malformed": 10_400}, summary
    assert re.search(r'^outbox_resolver_ledger_records_rejected_total\{reason="malformed"\} '
                     r'10500\.0$', text, re.M), text
    finish_and_check(env, produced)


def test_a_record_signed_with_a_replaced_key_reads_as_another_key(tenv: Env) -> None:
    """The key replaced while a batch is in doubt (the row deleted and inserted again as
    `migrate` does; `migrate` itself waits for the batch: its prepared transaction holds the
    outbox's lock): the relay's record carries the old key's id, so the resolver says "another
    key", not "forgery", and rolls the batch back (duplicates, never loss)."""
    env = tenv
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 60, exchange=env.exchange,
                                         routing_key=env.routing_key)
    doomed = env.spawn("relay", OUTBOX_BATCH_SIZE=str(BATCH), OUTBOX_TEST_CRASH_AT="after_ledger")
    wait_until(lambda: doomed.poll() is not None, 60, "the crash after the ledger record")
    (gid,) = in_doubt(env)
    old_key = ledger_key(env)
    with env.connect() as conn:
        conn.execute(sql.SQL("DELETE FROM {}").format(Tables(env.table).ledger_key))
        conn.execute(sql.SQL("INSERT INTO {} (key) VALUES (uuid_send(gen_random_uuid())"
                             " || uuid_send(gen_random_uuid()))").format(
                                 Tables(env.table).ledger_key))
    assert ledger_key(env) != old_key

    code, lines = resolve_once(env)

    assert code == 0, lines
    assert [line["gid"] for line in actions(lines, "resolved_rolled_back")] == [gid]
    (rejected,) = actions(lines, "ledger_record_rejected")
    assert (rejected["gid"], rejected["reason"]) == (gid, "other_key"), rejected
    assert ledger.key_id(old_key) in rejected["message"], rejected
    report = finish_and_check(env, produced, max_duplicates=BATCH)
    assert report.duplicates == BATCH


# -- who else can read the key (issue 32) ---------------------------------------------------------


@pytest.fixture
def key_roles(tenv: Env) -> Iterator[dict[str, str]]:
    """Roles of the test's own: {name: role}; dropped afterwards."""
    names = {name: f"k{tenv.gid_prefix}_{name}" for name in
             ("reader", "column", "group", "member", "noinherit", "bystander", "owner")}
    with tenv.connect() as conn:
        for name, role in names.items():
            options = {"group": "NOLOGIN", "noinherit": "LOGIN NOINHERIT"}.get(name, "LOGIN")
            conn.execute(sql.SQL("CREATE ROLE {} " + options).format(sql.Identifier(role)))
    try:
        yield names
    finally:
        with tenv.connect() as conn:
            conn.execute(sql.SQL("ALTER TABLE {} OWNER TO CURRENT_USER").format(
                Tables(tenv.table).ledger_key))
            for role in names.values():
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def key_warnings(env: Env, program: str) -> list[dict[str, Any]]:
    """The ledger_key_readable lines of ``program`` at start (the relay is stopped once up)."""
    if program == "resolver":
        code, lines = resolve_once(env)
        assert code == 0, lines
    else:
        relay = env.spawn("relay", OUTBOX_LOG_FORMAT="json")
        wait_until(lambda: "relay_started" in log_of(relay), 30, "the relay to start")
        time.sleep(0.5)
        assert stop(relay) == 0, log_of(relay)
        lines = [json.loads(line) for line in log_of(relay).splitlines() if line.startswith("{")]
    return actions(lines, "ledger_key_readable")


def test_no_warning_when_only_the_programs_role_reads_the_key(tenv: Env,
                                                              key_roles: dict[str, str]) -> None:
    assert key_warnings(tenv, "resolver") == []


@pytest.mark.parametrize("program", ["relay", "resolver"])
def test_both_programs_name_every_other_role_that_can_read_the_key(
        tenv: Env, key_roles: dict[str, str], program: str) -> None:
    """A grant, a grant of the key column only (as sql/roles.sql grants the relays' role), an
    inherited membership, a membership without INHERIT (SET ROLE), a member of the table's
    owner; never this role, superusers or the owner itself; a role with nothing stays out."""
    env, roles = tenv, key_roles
    key, ident = Tables(env.table).ledger_key, sql.Identifier
    with env.connect() as conn:
        conn.execute(sql.SQL("GRANT SELECT ON {} TO {}").format(key, ident(roles["reader"])))
        conn.execute(sql.SQL("GRANT SELECT (key) ON {} TO {}").format(key, ident(roles["column"])))
        conn.execute(sql.SQL("GRANT SELECT ON {} TO {}").format(key, ident(roles["group"])))
        for member in ("member", "noinherit"):
            conn.execute(sql.SQL("GRANT {} TO {}").format(ident(roles["group"]),
                                                          ident(roles[member])))
        conn.execute(sql.SQL("ALTER TABLE {} OWNER TO {}").format(key, ident(roles["owner"])))

    (warning,) = key_warnings(env, program)

    assert warning["roles"] == sorted(roles[n] for n in ("reader", "column", "member", "noinherit"))
    assert warning["public"] is False
    assert "can sign ledger records" in warning["message"]


def test_public_access_to_the_key_is_named(tenv: Env, key_roles: dict[str, str]) -> None:
    with tenv.connect() as conn:
        conn.execute(sql.SQL("GRANT SELECT ON {} TO PUBLIC").format(Tables(tenv.table).ledger_key))

    (warning,) = key_warnings(tenv, "resolver")

    assert warning["public"] is True and "PUBLIC (every role)" in warning["message"]
    assert set(key_roles.values()) - {key_roles["group"]} <= set(warning["roles"])
