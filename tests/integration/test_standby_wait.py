"""OUTBOX_STANDBY_WAIT after a failover: the promoted primary has no standby until one is
rebuilt, and nothing is published until then (the guarantee), as a named state: the relay's
``outbox_relay_waiting_for_standby`` gauge (issue 32)."""

from __future__ import annotations

import time
from typing import Any

from devenv import checker
from devenv.servers import PostgresPair, RabbitServer
from outbox_relay.relay.publisher import AmqpPublisher
from outbox_relay.relay.store import OutboxStore
from outbox_relay.relay.worker import Relay
from outbox_relay.tables import Tables
from tests.conftest import Env, External, finish_env
from tests.integration.test_failover import async_pair, pair_env  # noqa: F401 (a fixture)
from tests.integration.test_pipeline import in_doubt, outbox_count


def waiting_relay(env: Env) -> Relay:
    settings = env.relay_settings(standby_wait="standby", standby_wait_timeout=0.5,
                                  batch_size=40, connect_timeout=3, reconnect_max_delay=1)
    store = OutboxStore(settings.database_url, settings.table, connect_timeout=3,
                        standby_wait=settings.standby_wait,
                        standby_wait_timeout=settings.standby_wait_timeout)
    publisher = AmqpPublisher(settings.amqp_url, ledger_stream=settings.ledger_stream,
                              ledger_max_age=settings.ledger_max_age,
                              confirm_timeout=settings.confirm_timeout, connect_timeout=3)
    return Relay(settings, store, publisher)


def turn(relay: Relay) -> None:
    """One turn of the relay's loop, with its fault handling (no backoff sleep)."""
    try:
        relay.turn()
    except Relay.faults as exc:
        relay.on_fault(exc)
        time.sleep(0.1)


def value(relay: Relay, name: str) -> float:
    sample = relay.metrics.registry.get_sample_value(name)
    assert sample is not None
    return sample


def produce(env: Env, lo: int, count: int) -> list[str]:
    with env.connect() as conn:
        return checker.insert_events(conn, env.table, count, exchange=env.exchange,
                                     routing_key=env.routing_key, start=lo)


def attempts(env: Env) -> set[int]:
    from psycopg import sql
    with env.connect() as conn:
        rows = conn.execute(sql.SQL("SELECT DISTINCT attempts FROM {}").format(
            Tables(env.table).outbox)).fetchall()
    return {r[0] for r in rows}


def run_until(relay: Relay, done: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        turn(relay)


def test_the_standby_wait_is_a_named_state_until_a_standby_is_back(
    async_pair: PostgresPair, rabbit_server: RabbitServer | External,  # noqa: F811
) -> None:
    env = pair_env(async_pair, rabbit_server)
    relay = waiting_relay(env)
    try:
        first = produce(env, 0, 100)
        run_until(relay, lambda: outbox_count(env) == 0, 60, "the first events to go out")
        assert value(relay, "outbox_relay_waiting_for_standby") == 0

        async_pair.failover()  # the promoted standby is a primary without a standby
        later = produce(env, 100, 100)
        run_until(relay, lambda: value(relay, "outbox_relay_standby_wait_timeouts_total") >= 3,
                  120, "batches to time out waiting for a standby")
        assert value(relay, "outbox_relay_waiting_for_standby") == 1
        # The guarantee: nothing published, nothing charged, nothing left in doubt.
        assert outbox_count(env) == 100 and attempts(env) == {0}
        assert in_doubt(env) == []
        assert value(relay, "outbox_relay_events_published_total") == 100

        async_pair.rebuild()  # a standby again, named as OUTBOX_STANDBY_WAIT says
        run_until(relay, lambda: outbox_count(env) == 0, 120, "the rest to go out")
        assert value(relay, "outbox_relay_waiting_for_standby") == 0
        report = env.drain_and_check(first + later)
        assert report.ok(), report.summary()
    finally:
        relay.close()
        finish_env(env, drop=False)
