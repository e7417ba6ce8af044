"""Demo producer for docker-compose.yml: makes the demo events routable, then INSERTs them steadily.

It runs on the outbox-relay image's Python (psycopg and pika are installed there), with this
folder mounted at /demo:

    python /demo/producer.py [--rate N] [--events N] ...

1. Declares a topic exchange and a queue bound to it with ``#`` (capped at
   DEMO_QUEUE_MAX_LENGTH messages, oldest dropped first, since nobody consumes it), so the relay's
   mandatory publishes are routable.
2. Inserts one event per transaction into the outbox with a plain INSERT (producer.sql), at
   DEMO_RATE events per second, until stopped (SIGTERM/SIGINT) or DEMO_EVENTS are written.

Every flag is also an environment variable (``--help``). Exit codes: 0 stopped or done, 1 a
server failed (compose restarts it), 2 bad configuration.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import pika
import pika.exceptions
import psycopg
from psycopg.types.json import Jsonb

from outbox_relay.errors import ConfigError, describe
from outbox_relay.runtime import logs, options
from outbox_relay.sql import parse_named
from outbox_relay.tables import Tables

log = logging.getLogger("demo-producer")

QUERIES = parse_named((Path(__file__).resolve().parent / "producer.sql").read_text("utf-8"))
ROUTING_KEY = "order.created"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be a positive number")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be zero or a positive integer")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _name(text: str) -> str:
    if not _NAME_RE.fullmatch(text):
        raise ValueError("must be 1-200 letters, digits or _.:- (not the default exchange)")
    return text


OPTIONS: tuple[options.Option[Any], ...] = (
    options.DATABASE_URL,
    options.AMQP_URL,
    options.TABLE,
    options.Option("rate", "DEMO_RATE", _positive_float, "20", "events inserted per second"),
    options.Option("events", "DEMO_EVENTS", _count, "0",
                  "stop after this many events (0: run until stopped)"),
    options.Option("exchange", "DEMO_EXCHANGE", _name, "demo",
                  "topic exchange the events are published to (declared here)"),
    options.Option("queue", "DEMO_QUEUE", _name, "demo.events",
                  "queue bound to the exchange with '#' (declared here)"),
    options.Option("queue_max_length", "DEMO_QUEUE_MAX_LENGTH", _positive_int, "10000",
                  "messages the unconsumed demo queue keeps (oldest dropped first)"),
    options.LOG_LEVEL,
    options.LOG_FORMAT,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="producer.py",
        description="Insert demo events into the outbox at a steady rate, after declaring an "
        "exchange and a queue that make them routable. Every flag can also be set by the "
        "environment variable shown in its help.")
    options.add_options(parser, OPTIONS)
    return parser


def declare_topology(amqp_url: str, exchange: str, queue: str, max_length: int) -> None:
    """The exchange the events go to and a queue bound to everything on it."""
    params = pika.URLParameters(amqp_url)
    params.connection_attempts = 1
    params.client_properties = {"connection_name": "outbox demo producer"}
    conn = pika.BlockingConnection(params)
    try:
        channel = conn.channel()
        channel.exchange_declare(exchange, exchange_type="topic", durable=True)
        channel.queue_declare(queue, durable=True, arguments={
            "x-max-length": max_length, "x-overflow": "drop-head"})
        channel.queue_bind(queue, exchange, routing_key="#")
    finally:
        conn.close()


def produce(conn: psycopg.Connection[Any], table: str, *, exchange: str, rate: float,
            events: int, should_stop: Callable[[], bool]) -> int:
    """Insert events, one transaction each, at ``rate`` per second; returns how many."""
    insert = Tables(table).compose(QUERIES["insert_event"])
    interval = 1.0 / rate
    started = next_report = time.monotonic()
    produced = 0
    while not should_stop() and (events == 0 or produced < events):
        order = produced + 1
        with conn.transaction():
            conn.execute(insert, {
                "exchange": exchange, "routing_key": ROUTING_KEY,
                "ordering_key": f"order-{order % 100}",
                "payload": Jsonb({"order_id": order, "amount": f"{order % 997}.{order % 100:02d}"}),
            })
        produced += 1
        now = time.monotonic()
        if now >= next_report:
            log.info("produced %d events", produced, extra={
                "action": "demo_events_produced", "events": produced})
            next_report = now + 10
        # Keep to the schedule rather than sleeping a fixed time after each insert.
        time.sleep(max(0.0, started + produced * interval - time.monotonic()))
    return produced


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        values = options.resolve(args, OPTIONS)
    except ConfigError as exc:
        print(f"producer.py: error: {exc}", file=sys.stderr)
        return 2
    logs.setup(values["log_level"], values["log_format"])
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()  # PID 1 in a container: without a handler SIGTERM would be ignored

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        declare_topology(values["amqp_url"], values["exchange"], values["queue"],
                         values["queue_max_length"])
        log.info("exchange and queue declared", extra={
            "action": "demo_topology_declared", "exchange": values["exchange"],
            "queue": values["queue"]})
        with psycopg.connect(values["database_url"], autocommit=True,
                             application_name="outbox demo producer") as conn:
            produced = produce(conn, values["table"], exchange=values["exchange"],
                               rate=values["rate"], events=values["events"],
                               should_stop=stop.is_set)
    except (psycopg.Error, pika.exceptions.AMQPError, OSError) as exc:
        # Neither libpq's nor pika's messages contain the URL's password.
        log.error("demo producer failed: %s", describe(exc),
                  extra={"action": "demo_producer_failed"})
        return 1
    log.info("demo producer stopped after %d events", produced, extra={
        "action": "demo_producer_stopped", "events": produced})
    print(json.dumps({"produced": produced}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
