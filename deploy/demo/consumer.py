"""Demo consumer for docker-compose.yml: shows the events arriving, and drops copies by message_id.

It runs on the outbox-relay image's Python (pika is installed there), with this folder mounted
at /demo:

    python /demo/consumer.py [--queue NAME] [--events N] ...

Waits for the demo queue (the demo producer declares it), then consumes it with manual acks and
logs every 10 s how many events arrived and how many copies it dropped. The relay delivers at
least once: after a crash, a batch may arrive twice, every copy with the same AMQP message_id.
A real consumer records the ids it has processed in its own database, in the same transaction as
the work they cause; this one keeps the last DEMO_SEEN_LIMIT ids in memory, which is enough to
show the copies of a crashed relay's batch being dropped.

Every flag is also an environment variable (``--help``). Exit codes: 0 stopped (SIGTERM/SIGINT)
or DEMO_EVENTS distinct events received, 1 RabbitMQ failed (compose restarts it), 2 bad
configuration. On exit it prints {"received": N, "duplicates": M} on stdout.
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
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import pika
import pika.exceptions

from outbox_relay.errors import ConfigError, describe
from outbox_relay.runtime import logs, options

log = logging.getLogger("demo-consumer")

_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")


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
        raise ValueError("must be 1-200 letters, digits or _.:-")
    return text


OPTIONS: tuple[options.Option[Any], ...] = (
    options.AMQP_URL,
    options.Option("queue", "DEMO_QUEUE", _name, "demo.events",
                  "queue to consume (the demo producer declares it)"),
    options.Option("events", "DEMO_EVENTS", _count, "0",
                  "stop after this many distinct events (0: run until stopped)"),
    options.Option("seen_limit", "DEMO_SEEN_LIMIT", _positive_int, "100000",
                  "message ids remembered to drop copies (the most recent ones)"),
    options.LOG_LEVEL,
    options.LOG_FORMAT,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consumer.py",
        description="Consume the demo events, dropping copies by message_id. Every flag can "
        "also be set by the environment variable shown in its help.")
    options.add_options(parser, OPTIONS)
    return parser


@dataclass
class Dedup:
    """The ids of the last ``limit`` distinct messages: a copy of one of them is dropped."""

    limit: int
    received: int = 0
    duplicates: int = 0
    _seen: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def first_time(self, message_id: str | None) -> bool:
        """True for a message to process, False for a copy to drop (ack it all the same)."""
        if message_id is None:  # not from the relay: nothing to deduplicate by
            self.received += 1
            return True
        if message_id in self._seen:
            self._seen.move_to_end(message_id)
            self.duplicates += 1
            return False
        self._seen[message_id] = None
        if len(self._seen) > self.limit:
            self._seen.popitem(last=False)
        self.received += 1
        return True


def wait_for_queue(amqp_url: str, queue: str, should_stop: Callable[[], bool]) -> bool:
    """Wait until the queue exists (the producer declares it with its own arguments)."""
    while not should_stop():
        conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
        try:
            conn.channel().queue_declare(queue, passive=True)
            return True
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code != 404:
                raise
        finally:
            if conn.is_open:
                conn.close()
        time.sleep(1)
    return False


def consume(amqp_url: str, queue: str, dedup: Dedup, *, events: int,
            should_stop: Callable[[], bool]) -> None:
    params = pika.URLParameters(amqp_url)
    params.client_properties = {"connection_name": "outbox demo consumer"}
    conn = pika.BlockingConnection(params)
    try:
        channel = conn.channel()
        channel.basic_qos(prefetch_count=200)
        next_report = time.monotonic() + 10
        for method, properties, body in channel.consume(queue, inactivity_timeout=0.5):
            if method is not None:
                if dedup.first_time(properties.message_id):
                    log.debug("event %s: %s", properties.message_id, body[:200].decode(errors="replace"),
                              extra={"action": "demo_event", "routing_key": method.routing_key})
                channel.basic_ack(method.delivery_tag)
            now = time.monotonic()
            done = bool(events) and dedup.received >= events
            if now >= next_report or done or should_stop():
                log.info("received %d events, dropped %d copies", dedup.received, dedup.duplicates,
                         extra={"action": "demo_events_consumed", "events": dedup.received,
                                "duplicates": dedup.duplicates})
                next_report = now + 10
            if done or should_stop():
                break
        channel.cancel()
    finally:
        if conn.is_open:
            conn.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        values = options.resolve(args, OPTIONS)
    except ConfigError as exc:
        print(f"consumer.py: error: {exc}", file=sys.stderr)
        return 2
    logs.setup(values["log_level"], values["log_format"])
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()  # PID 1 in a container: without a handler SIGTERM would be ignored

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    dedup = Dedup(values["seen_limit"])
    try:
        if wait_for_queue(values["amqp_url"], values["queue"], stop.is_set):
            log.info("consuming", extra={"action": "demo_consumer_started", "queue": values["queue"]})
            consume(values["amqp_url"], values["queue"], dedup, events=values["events"],
                    should_stop=stop.is_set)
    except (pika.exceptions.AMQPError, OSError) as exc:
        # pika's messages do not contain the URL's password.
        log.error("demo consumer failed: %s", describe(exc), extra={"action": "demo_consumer_failed"})
        return 1
    print(json.dumps({"received": dedup.received, "duplicates": dedup.duplicates}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
