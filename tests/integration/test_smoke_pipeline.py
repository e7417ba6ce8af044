"""The protocol end to end in-process: rows in, messages out, nothing left behind."""

from __future__ import annotations

from devenv import checker
from relay.publisher import AmqpPublisher
from relay.store import OutboxStore
from relay.worker import Relay
from tests.conftest import Env


def make_relay(env: Env, **overrides: object) -> Relay:
    settings = env.relay_settings(**overrides)
    store = OutboxStore(settings.database_url, settings.table)
    publisher = AmqpPublisher(settings.amqp_url, ledger_stream=settings.ledger_stream,
                              ledger_max_age=settings.ledger_max_age,
                              confirm_timeout=settings.confirm_timeout,
                              connect_timeout=settings.connect_timeout)
    return Relay(settings, store, publisher)


def drain_relay(relay: Relay, max_batches: int = 10_000) -> None:
    relay._ensure_connected()
    for _ in range(max_batches):
        if relay.run_batch() == 0:
            return
    raise AssertionError("outbox never emptied")


def test_events_are_relayed_exactly_once(env: Env) -> None:
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 1200, exchange=env.exchange,
                                         routing_key=env.routing_key)
    relay = make_relay(env, batch_size=500)
    drain_relay(relay)
    relay.close()
    deliveries = checker.drain(env.amqp_url, env.queue, expected=set(produced))
    with env.connect() as conn:
        report = checker.check(produced, deliveries, conn=conn, table=env.table,
                               gid_prefix=env.gid_prefix)
    assert report.ok(), report.summary()
    assert report.order_violations == {}
    assert relay.metrics.events_published._value.get() == 1200
