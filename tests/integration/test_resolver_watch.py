"""The resolver takes over a killed relay's batch between its scans (issue 9, item 7).

With a scan interval far longer than the test, only the watch (resolver/watch.py) can have
woken the resolver: the batch must be finished within seconds of the relay's death. A relay
that is alive, holding a prepared batch, must not wake it (its lock is held).
"""

from __future__ import annotations

import signal
import time

from devenv import checker
from tests.conftest import Env
from tests.integration.test_pipeline import in_doubt, log_of, outbox_count, stop, wait_until

SCAN_INTERVAL = "600"  # no second scan during the test: only the watch can wake the resolver


def test_a_killed_relays_batch_is_taken_over_between_scans(env: Env) -> None:
    resolver = env.spawn("resolver", OUTBOX_RESOLVER_INTERVAL=SCAN_INTERVAL)
    wait_until(lambda: "resolver started" in log_of(resolver), 30, "the resolver to start")
    time.sleep(1.0)  # its first scan is done: the next one is 600 s away
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 100, exchange=env.exchange,
                                         routing_key=env.routing_key)
    doomed = env.spawn("relay", OUTBOX_BATCH_SIZE="40", OUTBOX_TEST_CRASH_AT="after_prepare",
                       OUTBOX_TEST_CRASH_AFTER="1")
    assert doomed.wait(60) == -signal.SIGKILL, log_of(doomed)
    killed = time.monotonic()
    # Generous for a shared machine; the benchmark measures the real figure (0.1-0.3 s).
    wait_until(lambda: not in_doubt(env), 10, "the watch to wake the resolver")
    assert time.monotonic() - killed < 10
    assert "resolved_rolled_back" in log_of(resolver)

    finisher = env.spawn("relay", OUTBOX_BATCH_SIZE="40")
    wait_until(lambda: outbox_count(env) == 0, 60, "the outbox to empty")
    assert stop(finisher) == 0
    assert stop(resolver) == 0
    report = env.drain_and_check(produced)
    assert report.ok(), report.summary()


def test_a_live_relays_prepared_batch_does_not_wake_the_resolver(env: Env) -> None:
    with env.connect() as conn:
        checker.insert_events(conn, env.table, 10, exchange=env.exchange,
                              routing_key=env.routing_key)
    # A live relay stalled right after PREPARE: its batch is prepared, its lock held.
    slow = env.spawn("relay", OUTBOX_TEST_CRASH_AT="after_prepare", OUTBOX_TEST_CRASH_AFTER="0",
                     OUTBOX_TEST_STALL_SECONDS="8")
    wait_until(lambda: len(in_doubt(env)) == 1, 30, "the slow relay's batch to be prepared")
    resolver = env.spawn("resolver", OUTBOX_RESOLVER_INTERVAL=SCAN_INTERVAL)
    wait_until(lambda: "resolver started" in log_of(resolver), 30, "the resolver to start")
    time.sleep(2.0)  # twenty watch checks while the relay stalls
    assert len(in_doubt(env)) == 1
    assert "resolved_" not in log_of(resolver)
    assert stop(slow) == 0
    assert stop(resolver) == 0
