"""The protocol end to end in-process: rows in, messages out, nothing left behind."""

from __future__ import annotations

import pytest

from devenv import checker
from outbox_relay.relay.publisher import AmqpPublisher
from outbox_relay.relay.store import OutboxStore
from outbox_relay.relay.worker import Relay
from tests.conftest import Env

pytestmark = pytest.mark.core  # run on every tested PostgreSQL (CONTRIBUTING.md)


def make_relay(env: Env, *, background_stats: bool = False, **overrides: object) -> Relay:
    """A relay in this process. Its stats passes run in ``turn`` when due (a test drives them),
    unless ``background_stats``: then on their thread, started by ``run``."""
    settings = env.relay_settings(**overrides)
    store = OutboxStore(settings.database_url, settings.table)
    publisher = AmqpPublisher(settings.amqp_url, ledger_stream=settings.ledger_stream,
                              ledger_max_age=settings.ledger_max_age,
                              confirm_timeout=settings.confirm_timeout,
                              connect_timeout=settings.connect_timeout)
    return Relay(settings, store, publisher, background_stats=background_stats)


def drain_relay(relay: Relay, max_batches: int = 10_000) -> None:
    relay.ensure_connected()
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
    report = env.drain_and_check(produced)
    assert report.ok(), report.summary()
    assert report.order_violations == {}
    assert relay.metrics.events_published._value.get() == 1200


def test_a_mixed_case_schema_qualified_table_works_end_to_end(env: Env) -> None:
    import psycopg
    from psycopg import sql

    from outbox_relay.schema import migrate

    mixed = Env(**{**env.__dict__, "table": f"OutboxSchema_{env.gid_prefix}.Events",
                   "processes": []})
    with env.connect() as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(
            sql.Identifier(f"OutboxSchema_{env.gid_prefix}")))
    try:
        migrate(mixed.db_url, mixed.table)
        with mixed.connect() as conn:
            produced = checker.insert_events(conn, mixed.table, 20, exchange=env.exchange,
                                             routing_key=env.routing_key)
        relay = make_relay(mixed)
        drain_relay(relay)  # connect() runs the schema check against the quoted names
        relay.close()
        deliveries = checker.drain(env.amqp_url, env.queue, expected=set(produced))
        assert checker.check(produced, deliveries).ok()
    finally:
        with psycopg.connect(env.db_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(
                sql.Identifier(f"OutboxSchema_{env.gid_prefix}")))
