"""The relay and resolver as real processes against real PostgreSQL and RabbitMQ."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from psycopg import sql

from devenv import checker
from outbox_relay.tables import Tables
from tests.conftest import Env

pytestmark = pytest.mark.core  # run on every tested PostgreSQL (CONTRIBUTING.md)


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def outbox_count(env: Env) -> int:
    with env.connect() as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(Tables(env.table).outbox))
        return int(row.fetchone()[0])  # type: ignore[index]


def relay_transactions(env: Env) -> int:
    """Open transactions of the relay's sessions ("outbox-relay" and "outbox-relay claim")."""
    with env.connect() as db:
        row = db.execute("SELECT count(*) FROM pg_stat_activity WHERE starts_with("
                         "application_name, 'outbox-relay') AND xact_start IS NOT NULL"
                         ).fetchone()
    assert row is not None
    return int(row[0])


def in_doubt(env: Env, *, older_than: float = 0.0) -> list[str]:
    """This table's in-doubt gids, those prepared more than ``older_than`` seconds ago."""
    with env.connect() as conn:
        rows = conn.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE starts_with(gid, %s)"
            " AND prepared <= now() - make_interval(secs => %s)",
            (env.gid_prefix + ":", older_than)).fetchall()
    return [r[0] for r in rows]


def log_of(proc: subprocess.Popen[bytes]) -> str:
    return Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]


def json_lines(text: str) -> list[dict[str, Any]]:
    """A log written with OUTBOX_LOG_FORMAT=json, one object per line."""
    lines = []
    for raw in text.splitlines():
        line = json.loads(raw)  # every line is one JSON object, tracebacks included
        assert isinstance(line, dict), raw
        lines.append(line)
    return lines


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> int:
    """SIGTERM once the program has installed its handlers (a SIGTERM during imports kills it)."""
    wait_until(lambda: proc.poll() is not None or " started" in log_of(proc), 30,
               "the program to start")
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout)


def test_four_relays_deliver_20000_events_exactly_once(env: Env) -> None:
    with env.connect() as conn:
        # 2,000 ordering keys: a batch of 200 holds about 190, and the relays share the rest
        # (a key's next rows wait for its batch in flight, whichever relay holds it).
        produced = checker.insert_events(conn, env.table, 20_000, exchange=env.exchange,
                                         routing_key=env.routing_key, per_transaction=5000,
                                         keys=2000)
    relays = [env.spawn("relay", OUTBOX_BATCH_SIZE="200", OUTBOX_LOG_LEVEL="DEBUG")
              for _ in range(4)]
    wait_until(lambda: outbox_count(env) == 0, 180, "the outbox to empty")
    for proc in relays:
        assert stop(proc) == 0, log_of(proc)
    report = env.drain_and_check(produced)
    assert report.ok(max_duplicates=0), report.summary()
    # Every relay did part of the work: the claim does not serialize them.
    for proc in relays:
        assert "batch committed" in log_of(proc), log_of(proc)


@pytest.mark.parametrize(
    ("crash_at", "duplicates_expected"),
    [("after_prepare", False), ("after_publish", True), ("after_ledger", False)],
)
def test_killed_relay_is_recovered_by_the_resolver(
    env: Env, crash_at: str, duplicates_expected: bool
) -> None:
    batch = 50
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 300, exchange=env.exchange,
                                         routing_key=env.routing_key)
    crashing = env.spawn("relay", OUTBOX_BATCH_SIZE=str(batch), OUTBOX_TEST_CRASH_AT=crash_at,
                         OUTBOX_TEST_CRASH_AFTER="1")
    assert crashing.wait(60) == -signal.SIGKILL, log_of(crashing)
    # The killed relay's batch is in doubt, its rows locked: nobody else may publish them.
    gids = in_doubt(env)
    assert len(gids) == 1, gids
    resolver = subprocess.run(
        [sys.executable, "-m", "outbox_relay.resolver", "--once"], env=env.cli_env(), capture_output=True,
        timeout=60, text=True)
    assert resolver.returncode == 0, resolver.stderr
    expected = "committed" if crash_at == "after_ledger" else "rolled back"
    assert f"in-doubt batch {expected}" in resolver.stderr, resolver.stderr
    assert in_doubt(env) == []
    # A healthy relay finishes the rest (and the rolled-back batch).
    relay = env.spawn("relay", OUTBOX_BATCH_SIZE=str(batch))
    wait_until(lambda: outbox_count(env) == 0, 60, "the outbox to empty")
    assert stop(relay) == 0
    report = env.drain_and_check(produced)
    assert report.ok(max_duplicates=batch), report.summary()
    if duplicates_expected:
        assert report.duplicates == batch, report.summary()
    else:
        assert report.duplicates == 0, report.summary()


def test_resolver_leaves_a_live_relays_young_batch_alone(env: Env) -> None:
    """A relay stuck between PREPARE and publish (but alive) keeps its batch until the limit."""
    with env.connect() as conn:
        checker.insert_events(conn, env.table, 10, exchange=env.exchange,
                              routing_key=env.routing_key)
    relay = env.spawn("relay", OUTBOX_TEST_CRASH_AT="after_prepare")
    wait_until(lambda: relay.poll() is not None, 30, "the crash")
    gid = in_doubt(env)[0]
    # Simulate the live relay: a session holding that relay's instance lock.
    from outbox_relay.gid import Gid, lock_class
    parsed = Gid.parse(gid)
    assert parsed is not None
    with env.connect() as holder:
        holder.execute("SELECT pg_advisory_lock(%s, %s)",
                       (lock_class(env.gid_prefix), parsed.instance))
        once = subprocess.run([sys.executable, "-m", "outbox_relay.resolver", "--once"], env=env.cli_env(),
                              capture_output=True, timeout=60, text=True)
        assert once.returncode == 0, once.stderr
        assert in_doubt(env) == [gid]
        # Past the hard limit the resolver acts even though the relay looks alive.
        wait_until(lambda: holder.execute(
            "SELECT now() - prepared > interval '1.5 s' FROM pg_prepared_xacts WHERE gid = %s",
            (gid,)).fetchone() == (True,), 10, "the batch to age")
        once = subprocess.run(
            [sys.executable, "-m", "outbox_relay.resolver", "--once"],
            env=env.cli_env(OUTBOX_RESOLVER_HARD_LIMIT="1"), capture_output=True, timeout=60,
            text=True)
        assert once.returncode == 0, once.stderr
        assert "in-doubt batch rolled back" in once.stderr
    assert in_doubt(env) == []
    assert outbox_count(env) == 10


def test_resolver_loop_leaves_a_slow_live_relay_alone(env: Env) -> None:
    """A real relay stalls 4 s between its confirms and its ledger record (alive, holding its
    instance lock) while a resolver scans every 0.2 s: the batch is the relay's to finish."""
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 30, exchange=env.exchange,
                                         routing_key=env.routing_key)
    resolver = env.spawn("resolver", OUTBOX_RESOLVER_INTERVAL="0.2")
    relay = env.spawn("relay", OUTBOX_BATCH_SIZE="10", OUTBOX_LOG_LEVEL="DEBUG",
                      OUTBOX_TEST_CRASH_AT="after_publish", OUTBOX_TEST_CRASH_AFTER="1",
                      OUTBOX_TEST_STALL_SECONDS="8")
    # The batch before the stalled one is in doubt for milliseconds: wait for one that has been
    # in doubt for a second, which only the stalled batch can be.
    wait_until(lambda: in_doubt(env, older_than=1.0), 30, "the stalled batch to be prepared")
    stalled = in_doubt(env, older_than=1.0)
    time.sleep(2)  # ten scans while the batch is in doubt (the stall lasts 8 s)
    assert in_doubt(env) == stalled
    wait_until(lambda: outbox_count(env) == 0 and not in_doubt(env), 30, "the relay to finish")
    assert stop(relay) == 0 and stop(resolver) == 0
    assert "resolved_" not in log_of(resolver), log_of(resolver)
    assert f"batch committed [action=batch_committed gid={stalled[0]}" in log_of(relay)
    deliveries = checker.drain(env.amqp_url, env.queue, expected=set(produced))
    report = checker.check(produced, deliveries)
    assert report.ok(), report.summary()


def test_two_resolvers_at_once_finish_each_batch_once(env: Env) -> None:
    with env.connect() as conn:
        # A key each: the second relay's batch is not held back behind the first's keys.
        produced = checker.insert_events(conn, env.table, 40, exchange=env.exchange,
                                         routing_key=env.routing_key, keys=40)
    for crash_at in ("after_ledger", "after_publish"):
        proc = env.spawn("relay", OUTBOX_BATCH_SIZE="10", OUTBOX_TEST_CRASH_AT=crash_at)
        assert proc.wait(30) == -signal.SIGKILL
    assert len(in_doubt(env)) == 2
    resolvers = [subprocess.Popen([sys.executable, "-m", "outbox_relay.resolver", "--once"],
                                  env=env.cli_env(), stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
    outputs = [p.communicate(timeout=60)[1] for p in resolvers]
    assert all(p.returncode == 0 for p in resolvers), outputs
    text = "\n".join(outputs)
    assert text.count("in-doubt batch committed") == 1, text
    assert text.count("in-doubt batch rolled back") == 1, text
    assert in_doubt(env) == []
    relay = env.spawn("relay")
    wait_until(lambda: outbox_count(env) == 0, 60, "the outbox to empty")
    assert stop(relay) == 0
    deliveries = checker.drain(env.amqp_url, env.queue, expected=set(produced))
    report = checker.check(produced, deliveries)
    assert not report.lost and report.duplicates == 10, report.summary()


def test_foreign_prepared_transaction_is_never_touched(env: Env) -> None:
    foreign = [f"other:{env.gid_prefix}", f"{env.gid_prefix}x:0000abcd:1",
               f"{env.gid_prefix}:not-a-gid"]
    with env.connect() as conn:
        for gid in foreign:
            conn.execute("BEGIN")
            conn.execute("SELECT 1")
            conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
    try:
        once = subprocess.run([sys.executable, "-m", "outbox_relay.resolver", "--once"],
                              env=env.cli_env(OUTBOX_RESOLVER_HARD_LIMIT="0.1"),
                              capture_output=True, timeout=60, text=True)
        assert once.returncode == 0, once.stderr
        with env.connect() as conn:
            left = {r[0] for r in conn.execute("SELECT gid FROM pg_prepared_xacts")}
        assert set(foreign) <= left
    finally:
        with env.connect() as conn:
            for gid in foreign:
                conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))


def test_sigterm_stops_gracefully_and_a_second_signal_at_once(env: Env) -> None:
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 2000, exchange=env.exchange,
                                         routing_key=env.routing_key)
    relay = env.spawn("relay", OUTBOX_BATCH_SIZE="100")
    wait_until(lambda: outbox_count(env) < 2000, 30, "the relay to start")
    assert stop(relay) == 0, log_of(relay)
    assert "relay stopped" in log_of(relay)
    assert in_doubt(env) == []  # the batch in flight was finished, not abandoned
    relay = env.spawn("relay", OUTBOX_BATCH_SIZE="100")
    wait_until(lambda: outbox_count(env) == 0, 60, "the outbox to empty")
    # Two signals delivered together: the first asks for a graceful stop, the second ends it.
    # Which one Python handles second is not defined: the kernel may hand SIGTERM to another
    # thread while the main thread enters SIGINT's handler, and it then runs nested, first.
    relay.send_signal(signal.SIGSTOP)
    relay.send_signal(signal.SIGINT)
    relay.send_signal(signal.SIGTERM)
    relay.send_signal(signal.SIGCONT)
    assert relay.wait(10) in (128 + signal.SIGINT, 128 + signal.SIGTERM), log_of(relay)
    assert "second signal: exiting at once" in log_of(relay)
    assert "relay stopped" not in log_of(relay)
    deliveries = checker.drain(env.amqp_url, env.queue, expected=set(produced))
    report = checker.check(produced, deliveries)
    assert not report.lost and report.duplicates == 0, report.summary()
