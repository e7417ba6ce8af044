"""A RabbitMQ cluster's URLs, the ledger's replicas and the standby wait's settings."""

from __future__ import annotations

from typing import Any

import pika.exceptions
import pytest

from outbox_relay import rabbitmq
from outbox_relay.errors import ConfigError, StartupCheckError
from outbox_relay.relay import store
from outbox_relay.relay.settings import RELAY_OPTIONS
from outbox_relay.runtime.logs import redact
from outbox_relay.runtime.options import resolve
from tests.unit.test_config import ns

DB = "postgresql://relay:pw@db:5432/app"
THREE = ("amqp://relay:s3cret@mq-0:5672/%2F, amqp://relay:s3cret@mq-1:5673/%2F,"
         "amqp://relay:s3cret@mq-2:5674/%2F")


def values(amqp_url: str) -> dict[str, Any]:
    return resolve(ns(), RELAY_OPTIONS, {"OUTBOX_DATABASE_URL": DB, "OUTBOX_AMQP_URL": amqp_url})


def test_a_comma_separated_list_of_urls_is_accepted_and_split() -> None:
    url = values(THREE)["amqp_url"]
    assert rabbitmq.amqp_urls(url) == [
        "amqp://relay:s3cret@mq-0:5672/%2F", "amqp://relay:s3cret@mq-1:5673/%2F",
        "amqp://relay:s3cret@mq-2:5674/%2F"]


@pytest.mark.parametrize(("url", "position"), [
    ("amqp://relay:s3cret@mq-0/,http://relay:s3cret@mq-1/", "URL 2 of 2"),
    ("amqp://relay:s3cret@mq-0/,,amqp://relay:s3cret@mq-1/", "URL 2 of 3"),
    ("amqp://relay:s3cret@mq-0/,", "URL 2 of 2"),
    ("amqp://relay:s3cret@mq-0:99999/,amqp://relay:s3cret@mq-1/", "URL 1 of 2"),
])
def test_each_url_of_the_list_is_checked_alone_and_named_by_position(url: str, position: str) -> None:
    with pytest.raises(ConfigError) as info:
        values(url)
    message = str(info.value)
    assert message.startswith(f"OUTBOX_AMQP_URL {position} ")
    assert "s3cret" not in message and "\n" not in message


def test_a_list_never_shows_a_password_in_a_log_line() -> None:
    shown = redact(f"cannot connect to {THREE}")
    assert "s3cret" not in shown and "relay:***@" in shown


def test_pika_gets_one_parameter_set_per_node_in_a_random_order() -> None:
    orders = set()
    for _ in range(50):
        params = rabbitmq.connection_parameters(THREE, timeout=3, name="t")
        assert all(p.connection_attempts == 1 and p.socket_timeout == 3 for p in params)
        orders.add(tuple(p.port for p in params))
    assert {frozenset(o) for o in orders} == {frozenset({5672, 5673, 5674})}
    assert len(orders) > 1  # spread over the nodes


@pytest.mark.parametrize(("urls", "replicas"), [(1, 1), (2, 2), (3, 3), (5, 3)])
def test_the_ledger_gets_one_replica_per_node_three_at_most(urls: int, replicas: int) -> None:
    url = ",".join(f"amqp://g:g@mq-{n}/" for n in range(urls))
    assert rabbitmq.ledger_replicas(url) == replicas
    arguments = rabbitmq.ledger_arguments("7D", replicas)
    assert arguments.get("x-initial-cluster-size") == (replicas if replicas > 1 else None)


class Channel:
    """queue_declare answers with the broker's 406 for an existing stream of another size."""

    def __init__(self, existing: str | None, declared: list[dict[str, Any]]) -> None:
        self.existing, self.declared = existing, declared

    def queue_declare(self, *, queue: str, durable: bool, arguments: dict[str, Any]) -> None:
        self.declared.append(arguments)
        size = arguments.get("x-initial-cluster-size")
        if self.existing in (None, "none" if size is None else str(size)):
            return
        received = "none" if size is None else f"'{size}'"
        current = "none" if self.existing == "none" else f"the value '{self.existing}' of type 'signedint'"
        raise pika.exceptions.ChannelClosedByBroker(
            406, f"PRECONDITION_FAILED - inequivalent arg 'x-initial-cluster-size' for queue "
                 f"'{queue}' in vhost '/': received {received} but current is {current}")

    def exchange_declare(self, **_kw: Any) -> None: ...
    def queue_bind(self, **_kw: Any) -> None: ...


def declare(existing: str | None, replicas: int) -> list[dict[str, Any]]:
    declared: list[dict[str, Any]] = []
    rabbitmq.declare_ledger(Channel(existing, declared), "ledger", "7D", replicas=replicas,
                        reopen=lambda: Channel(existing, declared))
    return declared


def test_a_new_ledger_on_a_cluster_is_declared_replicated() -> None:
    assert declare(None, 3)[0]["x-initial-cluster-size"] == 3


def test_an_existing_replicated_ledger_of_another_size_is_used_as_it_is() -> None:
    assert [d.get("x-initial-cluster-size") for d in declare("2", 3)] == [3, 2]
    assert [d.get("x-initial-cluster-size") for d in declare("3", 1)] == [None, 3]


def test_a_ledger_declared_without_a_size_is_used_as_it_is() -> None:
    # RabbitMQ replicated it to every node of the cluster (measured on 3.10).
    assert [d.get("x-initial-cluster-size") for d in declare("none", 3)] == [3, None]


def test_a_single_replica_ledger_on_a_cluster_is_a_startup_error() -> None:
    with pytest.raises(StartupCheckError) as info:
        declare("1", 3)
    message = str(info.value)
    assert "single replica" in message and "\n" not in message
    assert "OUTBOX_LEDGER_STREAM" in message


def test_a_single_node_relay_keeps_the_ledger_declared_without_a_size() -> None:
    assert declare("none", 1) == [{"x-queue-type": "stream", "x-max-age": "7D"}]


@pytest.mark.parametrize(("value", "where"), [
    ("any", "true"), ("sync", "sync_state IN ('sync', 'quorum')"),
    ("standby-1", "application_name = %(name)s")])
def test_the_standby_wait_reads_the_named_standbys_flush_position(value: str, where: str) -> None:
    query = store.standby_flushed_query(value)
    assert "flush_lsn >= %(lsn)s::pg_lsn" in query and query.endswith(where)
    assert values(THREE)["standby_wait"] == ""  # off unless set
    assert resolve(ns(), RELAY_OPTIONS, {"OUTBOX_DATABASE_URL": DB, "OUTBOX_AMQP_URL": THREE,
                                         "OUTBOX_STANDBY_WAIT": value})["standby_wait"] == value


def test_a_bad_standby_name_is_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"^OUTBOX_STANDBY_WAIT must be empty"):
        resolve(ns(), RELAY_OPTIONS, {"OUTBOX_DATABASE_URL": DB, "OUTBOX_AMQP_URL": THREE,
                                      "OUTBOX_STANDBY_WAIT": "x'; DROP"})
