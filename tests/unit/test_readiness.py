"""/readyz names the failing server and a class of reason, never the error's text: libpq's and
pika's name the host, the port and the user, and the probe answers anyone who can reach the
port. The logs keep the whole error."""

from __future__ import annotations

import json

import pika.exceptions
import psycopg
import pytest

from outbox_relay.errors import DatabaseError, TransientError
from outbox_relay.runtime.health import Health, reason_of

SECRETS = ("db.internal", "10.0.0.5", "5432", "outbox_relay", "orders")


def wrapped(text: str, cause: BaseException) -> TransientError:
    """A TransientError as the programs raise it: ``raise ... from`` the driver's error."""
    try:
        raise TransientError(text) from cause
    except TransientError as exc:
        return exc


@pytest.mark.parametrize(("text", "reason"), [
    ('connection failed: connection to server at "db.internal" (10.0.0.5), port 5432 failed: '
     'FATAL:  password authentication failed for user "outbox_relay"', "authentication failed"),
    ('connection to server at "db.internal" (10.0.0.5), port 5432 failed: FATAL:  no pg_hba.conf '
     'entry for host "10.0.0.9", user "outbox_relay", database "orders", no encryption',
     "authentication failed"),
    ('connection to server at "db.internal" (10.0.0.5), port 5432 failed: Connection refused',
     "connection refused"),
    ("failed to resolve host 'db.internal': [Errno -2] Name or service not known",
     "host not found"),
    ("connection timeout expired", "timed out"),
    ("Is the server running on that host? something new", "error"),
    ('connection to server at "db.internal" (10.0.0.5), port 5432 failed: SSL error: '
     "certificate verify failed", "TLS failed"),
    ('connection to server at "db.internal" (10.0.0.5), port 5432 failed: FATAL:  sorry, too many '
     "clients already", "too many connections"),
    ('FATAL:  remaining connection slots are reserved for non-replication superuser connections',
     "too many connections"),
    ("FATAL:  the database system is shutting down", "server starting up or shutting down"),
    ('FATAL:  database "orders" does not exist', "does not exist"),
    ("server closed the connection unexpectedly", "connection lost"),
    ("instance lock busy (a resolver is checking it); retrying", "instance lock busy"),
])
def test_a_postgresql_error_is_told_by_its_class_of_reason(text: str, reason: str) -> None:
    error = wrapped(f"cannot connect to PostgreSQL: {text}", psycopg.OperationalError(text))
    assert reason_of(error) == (reason if reason != "error" else "OperationalError")


def test_a_pika_error_is_told_by_the_reason_in_its_arguments() -> None:
    refused = pika.exceptions.AMQPConnectionError(
        ConnectionRefusedError(111, "Connection refused"))
    assert reason_of(wrapped("cannot connect to RabbitMQ: AMQPConnectionError", refused)) \
        == "connection refused"
    lost = pika.exceptions.StreamLostError("Transport indicated EOF")
    assert reason_of(wrapped("cannot connect to RabbitMQ: StreamLostError", lost)) \
        == "connection lost"


def test_an_unknown_error_is_named_by_its_drivers_class_or_error() -> None:
    assert reason_of(wrapped("cannot connect: db.internal says no", KeyError("x"))) == "KeyError"
    assert reason_of(DatabaseError('relation "orders.outbox" is odd')) == "error"
    assert reason_of("something at db.internal") == "error"


def test_readiness_shows_the_server_and_the_reason_but_no_host_port_or_user() -> None:
    health = Health(("postgresql", "rabbitmq"), stall_after=30)
    text = ('connection failed: connection to server at "db.internal" (10.0.0.5), port 5432 '
            'failed: FATAL:  password authentication failed for user "outbox_relay"')
    health.set_check("postgresql", "reconnecting",
                     wrapped(f"cannot connect to PostgreSQL: {text}",
                             psycopg.OperationalError(text)))
    health.set_check("rabbitmq", "scan failed", DatabaseError('permission denied for table '
                                                               '"orders"'))
    ready, checks = health.readiness()
    assert not ready
    assert checks == {"postgresql": "reconnecting: authentication failed",
                      "rabbitmq": "scan failed: permission denied"}
    body = json.dumps(checks)
    assert not any(secret in body for secret in SECRETS), body
