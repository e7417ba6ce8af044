"""SIGKILL at every step of the protocol: nothing lost, nothing published twice by accident."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from devenv import checker
from relay.faults import CRASH_POINTS
from tests.conftest import ROOT, Env
from tests.integration.test_pipeline import in_doubt, log_of, outbox_count, stop, wait_until

BATCH = 40
# Crash points at which the broker may hold the batch while PostgreSQL rolls it back.
MAY_DUPLICATE = {"mid_publish", "after_publish"}


@pytest.mark.parametrize("crash_at", CRASH_POINTS)
def test_sigkill_at_each_step(env: Env, crash_at: str) -> None:
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 200, exchange=env.exchange,
                                         routing_key=env.routing_key)
    doomed = env.spawn("relay", OUTBOX_BATCH_SIZE=str(BATCH), OUTBOX_TEST_CRASH_AT=crash_at,
                       OUTBOX_TEST_CRASH_AFTER="1")
    assert doomed.wait(60) == -signal.SIGKILL, log_of(doomed)
    prepared = in_doubt(env)
    assert len(prepared) == (1 if crash_at in {"after_prepare", "mid_publish", "after_publish",
                                               "after_ledger"} else 0), prepared
    if prepared:
        # While the batch is in doubt no other relay may publish its rows: run one without a
        # resolver until it has nothing left it can claim.
        other = env.spawn("relay", OUTBOX_BATCH_SIZE=str(BATCH))
        wait_until(lambda: outbox_count(env) == BATCH, 30, "the other relay to drain the rest")
        assert stop(other) == 0
        assert in_doubt(env) == prepared
        early = checker.drain(env.amqp_url, env.queue, idle_timeout=1.0)
        copies = [d.message_id for d in early]
        assert len(copies) == len(set(copies)), "a row of the in-doubt batch went out twice"
        held = set(produced) - set(copies)
        if crash_at not in MAY_DUPLICATE | {"after_ledger"}:
            assert len(held) == BATCH  # the in-doubt rows stayed locked and unpublished
    else:
        early = []
    resolved = subprocess.run([sys.executable, "-m", "resolver", "--once"], env=env.cli_env(),
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert resolved.returncode == 0, resolved.stderr
    assert in_doubt(env) == []
    finisher = env.spawn("relay", OUTBOX_BATCH_SIZE=str(BATCH))
    wait_until(lambda: outbox_count(env) == 0, 60, "the outbox to empty")
    assert stop(finisher) == 0
    report = env.drain_and_check(produced, early=early)
    bound = BATCH if crash_at in MAY_DUPLICATE else 0
    assert report.ok(max_duplicates=bound), report.summary()
