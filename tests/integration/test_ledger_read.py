"""Reading the ledger up to the resolver's marker while relays keep appending behind it."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pika
import pytest

from outbox_relay import ledger, rabbitmq
from outbox_relay.errors import TransientError
from outbox_relay.resolver import ledger as ledger_reader
from tests.conftest import Env

KEY = b"k" * 32


def _append_until(stop: threading.Event, url: str, stream: str, prefix: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    channel = conn.channel()
    n = 0
    while not stop.is_set():
        for _ in range(50):
            n += 1
            channel.basic_publish(stream, stream, ledger.batch_record(
                KEY, gid=f"{prefix}:0000000b:{n}", xid=n, database="db", count=1, relay="b"))
        conn.process_data_events(time_limit=0)
    conn.close()


def _publish_marker(conn: Any, url: str, stream: str) -> tuple[Any, str]:
    """Append a marker; on a connection the broker closed, reconnect first (as the resolver)."""
    marker = ledger.new_marker()
    try:
        conn.channel().basic_publish(stream, stream, ledger.marker_record(KEY, marker))
    except rabbitmq.CONNECTION_ERRORS:
        conn = pika.BlockingConnection(pika.URLParameters(url))
        conn.channel().basic_publish(stream, stream, ledger.marker_record(KEY, marker))
    return conn, marker


def test_marker_read_survives_records_arriving_behind_the_marker(env: Env) -> None:
    # pika rejects the deliveries of a consumer it is cancelling that it has not dispatched, and
    # a stream answers basic.reject by closing the whole connection (540 NOT_IMPLEMENTED). A
    # relay appending records while the resolver reads makes such deliveries likely.
    conn = pika.BlockingConnection(pika.URLParameters(env.amqp_url))
    stop = threading.Event()
    appender = threading.Thread(target=_append_until,
                                args=(stop, env.amqp_url, env.ledger_stream, env.gid_prefix))
    try:
        channel = conn.channel()
        rabbitmq.declare_ledger(channel, env.ledger_stream, "7D")
        since = datetime.now(timezone.utc) - timedelta(seconds=1)
        gids = {f"{env.gid_prefix}:0000000a:{n}": n for n in range(1, 51)}
        for gid, xid in sorted(gids.items()):
            channel.basic_publish(env.ledger_stream, env.ledger_stream, ledger.batch_record(
                KEY, gid=gid, xid=xid, database="db", count=1, relay="a"))
        candidates = {gid: ledger.Expected(xid, "db") for gid, xid in gids.items()}
        appender.start()
        for _attempt in range(5):
            conn, marker = _publish_marker(conn, env.amqp_url, env.ledger_stream)
            found = ledger_reader.read_until_marker(conn, env.ledger_stream, since, marker, key=KEY,
                                             candidates=candidates, idle_timeout=30)
            assert set(found) == set(gids)  # only the candidates are kept
            # Ending the read rejected nothing, so the broker kept the connection open.
            assert conn.is_open, "the ledger read cost the reader its connection"
    finally:
        stop.set()
        appender.join(10)
        if conn.is_open:
            conn.close()


def test_a_ledger_deleted_under_the_resolver_fails_its_read_at_once(env: Env) -> None:
    """A marker the broker cannot route fails the read at once, not after the read timeout
    (30 s here): the resolver reconnects, declares the ledger again and scans again."""
    reader = ledger_reader.AmqpLedger(env.amqp_url, stream=env.ledger_stream, max_age="7D",
                                      read_timeout=30, connect_timeout=10)
    reader.connect()
    try:
        conn, channel = env.amqp_channel()
        channel.queue_delete(env.ledger_stream)  # the exchange stays: the marker is unroutable
        conn.close()
        started = time.monotonic()
        with pytest.raises(TransientError):
            reader.committed(KEY, datetime.now(timezone.utc), {}, on_progress=lambda: None,
                             on_rejected=lambda _r: None)
        assert time.monotonic() - started < 10
    finally:
        reader.close()
