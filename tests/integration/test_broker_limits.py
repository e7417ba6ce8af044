"""A message the broker itself refuses by closing the channel: the culprit is found and
dead-lettered, the rows around it are delivered. Runs on a RabbitMQ of its own with a small
max_message_size."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devenv import checker
from devenv.servers import RabbitServer
from tests.conftest import Env, make_env
from tests.integration.test_dead_letter import dead_letters, insert_row, run_until_empty
from tests.integration.test_smoke_pipeline import make_relay

LIMIT = 65536


@pytest.fixture(scope="module")
def small_rabbit() -> Iterator[RabbitServer]:
    with RabbitServer(extra_conf=[f"max_message_size = {LIMIT}"]) as server:
        yield server


def test_broker_refusing_a_message_fails_only_that_row(env: Env,
                                                       small_rabbit: RabbitServer) -> None:
    env = make_env(env.db_url, small_rabbit.url, tag="l")
    with env.connect() as db:
        head = checker.insert_events(db, env.table, 60, exchange=env.exchange,
                                     routing_key=env.routing_key, prefix="head")
        insert_row(env, message_id="too-big-for-the-broker", exchange=env.exchange,
                   routing_key="x", payload=None, payload_bytes=b"z" * (LIMIT * 2))
        tail = checker.insert_events(db, env.table, 60, exchange=env.exchange,
                                     routing_key=env.routing_key, prefix="tail")
    # The relay's own limit is left at its default: only the broker knows this one.
    relay = make_relay(env, batch_size=50, max_attempts=3)
    run_until_empty(env, relay, rounds=600)
    relay.close()
    dead = dead_letters(env)
    assert list(dead) == ["too-big-for-the-broker"], dead
    attempts, error = dead["too-big-for-the-broker"]
    assert attempts == 3 and "channel closed" in error, error
    produced = head + tail
    deliveries = checker.drain(env.amqp_url, env.queue, expected=set(produced))
    report = checker.check(produced, deliveries)
    # Rows unconfirmed when the channel closed may have reached the queue: at most one batch
    # of copies, each with the same message_id.
    assert not report.lost and not report.unexpected, report.summary()
    assert report.duplicates <= 50, report.summary()
    assert relay.metrics.row_failures.labels("channel_closed")._value.get() >= 3
    assert relay.metrics.batch_failures.labels("row_failures")._value.get() >= 3
