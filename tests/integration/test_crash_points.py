"""SIGKILL at every step of the protocol: nothing lost, nothing published twice by accident."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devenv import checker, launch
from outbox_relay.relay.faults import CRASH_POINTS
from tests.conftest import ROOT, Env
from tests.integration.test_pipeline import in_doubt, log_of, outbox_count, stop, wait_until

pytestmark = pytest.mark.core  # run on every tested PostgreSQL (CONTRIBUTING.md)

BATCH = 40
# Crash points at which the broker may hold the batch while PostgreSQL rolls it back.
MAY_DUPLICATE = {"mid_publish", "after_publish"}


@pytest.mark.parametrize("keys", [200, 4], ids=["key_per_event", "4_keys"])
@pytest.mark.parametrize("crash_at", CRASH_POINTS)
def test_sigkill_at_each_step(env: Env, crash_at: str, keys: int) -> None:
    """With a key per event, another relay publishes everything but the batch in doubt; with
    4 keys, that batch holds rows of every key, and nothing of them may go before it is
    finished (per-key order): the other relay publishes nothing."""
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 200, exchange=env.exchange,
                                         routing_key=env.routing_key, keys=keys)
    doomed = env.spawn("relay", OUTBOX_BATCH_SIZE=str(BATCH), OUTBOX_TEST_CRASH_AT=crash_at,
                       OUTBOX_TEST_CRASH_AFTER="1")
    assert doomed.wait(60) == -signal.SIGKILL, log_of(doomed)
    prepared = in_doubt(env)
    assert len(prepared) == (1 if crash_at in {"after_prepare", "mid_publish", "after_publish",
                                               "after_ledger"} else 0), prepared
    if prepared:
        # While the batch is in doubt no other relay may publish its rows: run one without a
        # resolver until it has nothing left it can claim.
        before = outbox_count(env)  # the doomed relay's first batch may have committed
        other = env.spawn("relay", OUTBOX_BATCH_SIZE=str(BATCH))
        if keys >= len(produced):
            wait_until(lambda: outbox_count(env) == BATCH, 30, "the other relay to drain the rest")
        else:
            wait_until(lambda: "rabbitmq connected" in log_of(other), 30, "the other relay")
            time.sleep(2)  # time for many claims: each finds every key held back
            assert outbox_count(env) == before
        assert stop(other) == 0
        assert in_doubt(env) == prepared
        early = checker.drain(env.amqp_url, env.queue, idle_timeout=1.0)
        copies = [d.message_id for d in early]
        assert len(copies) == len(set(copies)), "a row of the in-doubt batch went out twice"
        held = set(produced) - set(copies)
        if crash_at not in MAY_DUPLICATE | {"after_ledger"} and keys >= len(produced):
            assert len(held) == BATCH  # the in-doubt rows stayed locked and unpublished
    else:
        early = []
    resolved = subprocess.run([sys.executable, "-m", "outbox_relay.resolver", "--once"], env=env.cli_env(),
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert resolved.returncode == 0, resolved.stderr
    assert in_doubt(env) == []
    finisher = env.spawn("relay", OUTBOX_BATCH_SIZE=str(BATCH))
    wait_until(lambda: outbox_count(env) == 0, 60, "the outbox to empty")
    assert stop(finisher) == 0
    report = env.drain_and_check(produced, early=early)
    bound = BATCH if crash_at in MAY_DUPLICATE else 0
    assert report.ok(max_duplicates=bound), report.summary()


def test_the_installed_relay_ignores_crash_point_variables(env: Env, tmp_path: Path) -> None:
    """`outbox-relay run` as a deployment runs it (not through the tests' launcher), with a
    crash point set that would kill it at its first claim: it relays everything and lives."""
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 200, exchange=env.exchange,
                                         routing_key=env.routing_key)
    with open(tmp_path / "relay.log", "wb") as log:
        relay = subprocess.Popen(
            launch.command("relay"), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env=env.cli_env(OUTBOX_BATCH_SIZE=str(BATCH), OUTBOX_TEST_CRASH_AT="after_claim"))
    env.processes.append(relay)
    wait_until(lambda: outbox_count(env) == 0, 60, "the relay to empty the outbox")
    assert relay.poll() is None, (tmp_path / "relay.log").read_text()
    relay.send_signal(signal.SIGTERM)
    assert relay.wait(30) == 0
    report = env.drain_and_check(produced)
    assert report.ok(max_duplicates=0), report.summary()
