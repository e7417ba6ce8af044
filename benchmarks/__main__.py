"""Throughput benchmark: ``python -m benchmarks [--events N]`` (first cut, see README).

In one run against the same PostgreSQL and RabbitMQ it measures:

- ceiling: a bare pika publisher, same message size, persistent + mandatory, publisher
  confirms pipelined in windows: the rate one Python process gets into this broker;
- relay: events/s from a pre-filled outbox to committed, with 1, 2 and 4 relay processes;
- 2PC cost: the same relay loop with a plain COMMIT instead of PREPARE / COMMIT PREPARED
  (a store subclass that exists only here, never a production option).

Every relay run is checked with the total-queue checker (nothing lost, no duplicates), so a
fast wrong relay cannot look good. Results are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pika
import psycopg

from devenv import checker
from devenv.servers import PostgresServer, RabbitServer
from relay.config import RelaySettings
from relay.migrate import migrate
from relay.publisher import AmqpPublisher
from relay.store import OutboxStore
from relay.worker import Relay

EXCHANGE = "bench.events"
QUEUE = "bench.sink"
BODY = b'{"key": "k1", "seq": 1, "pad": "' + b"x" * 216 + b'"}'  # about 250 bytes


class PlainCommitStore(OutboxStore):
    """Benchmark only: the relay loop with a plain COMMIT, to price the two-phase commit."""

    def prepare(self, gid: str) -> None:
        pass  # the claim transaction stays open until finish()

    def finish(self, gid: str, *, commit: bool) -> bool:
        self.conn.execute("COMMIT" if commit else "ROLLBACK")
        return True


def ceiling(amqp_url: str, count: int, window: int) -> float:
    """Bare pika: publish ``count`` messages, ``window`` confirms in flight, return msgs/s."""
    from relay import amqp

    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    channel = conn.channel()._impl
    pending: set[int] = set()
    ready: list[bool] = []

    def on_confirm(frame: Any) -> None:
        tag, multiple = frame.method.delivery_tag, frame.method.multiple
        for t in [t for t in pending if t <= tag] if multiple else [tag]:
            pending.discard(t)

    channel.confirm_delivery(ack_nack_callback=on_confirm, callback=lambda _f: ready.append(True))
    amqp.pump(conn, lambda: bool(ready), 10)
    props = pika.BasicProperties(delivery_mode=2, content_type="application/json")
    started = time.perf_counter()
    tag = 0
    while tag < count:
        for _ in range(min(window, count - tag)):
            tag += 1
            props.message_id = f"ceiling-{tag}"
            channel.basic_publish(EXCHANGE, "bench", BODY, props, mandatory=True)
            pending.add(tag)
        amqp.pump(conn, lambda: not pending, 60)
    elapsed = time.perf_counter() - started
    conn.close()
    return count / elapsed


def _relay_process(settings: RelaySettings, plain: bool, go: Any, ready: Any) -> None:
    store_cls = PlainCommitStore if plain else OutboxStore
    store = store_cls(settings.database_url, settings.table)
    publisher = AmqpPublisher(settings.amqp_url, ledger_stream=settings.ledger_stream,
                              ledger_max_age=settings.ledger_max_age,
                              confirm_timeout=settings.confirm_timeout,
                              connect_timeout=settings.connect_timeout)
    relay = Relay(settings, store, publisher)
    relay._ensure_connected()
    ready.release()
    go.wait()
    while relay.run_batch():
        pass
    relay.close()


def relay_rate(db_url: str, amqp_url: str, count: int, processes: int, *, plain: bool,
               batch_size: int, tag: str) -> float:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
        produced = checker.insert_events(conn, "outbox", count, exchange=EXCHANGE,
                                         routing_key="bench", prefix=tag, per_transaction=10_000)
    settings = RelaySettings(database_url=db_url, amqp_url=amqp_url, batch_size=batch_size,
                             metrics_port=0)
    ctx = mp.get_context("fork")
    go, ready = ctx.Event(), ctx.Semaphore(0)
    procs = [ctx.Process(target=_relay_process, args=(settings, plain, go, ready))
             for _ in range(processes)]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.acquire()
    started = time.perf_counter()
    go.set()
    for proc in procs:
        proc.join()
    elapsed = time.perf_counter() - started
    deliveries = checker.drain(amqp_url, QUEUE, expected=set(produced), idle_timeout=1.0)
    report = checker.check(produced, deliveries)
    if report.lost or report.duplicates or report.unexpected:
        raise SystemExit(f"relay run {tag} delivered wrongly: {report.summary()}")
    return count / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--window", type=int, default=500, help="ceiling's confirms in flight")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results.json"))
    args = parser.parse_args(argv)

    with ExitStack() as stack:
        pg = stack.enter_context(PostgresServer(max_prepared_transactions=16))
        rabbit = stack.enter_context(RabbitServer())
        migrate(pg.url, "outbox")
        conn = pika.BlockingConnection(pika.URLParameters(rabbit.url))
        channel = conn.channel()
        channel.exchange_declare(EXCHANGE, exchange_type="topic", durable=True)
        channel.queue_declare(QUEUE, durable=True)
        channel.queue_bind(QUEUE, EXCHANGE, routing_key="#")
        conn.close()

        results: dict[str, Any] = {"events": args.events, "batch_size": args.batch_size,
                                   "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                                              f"Python {platform.python_version()}"}
        rate = ceiling(rabbit.url, args.events, args.window)
        results["ceiling_msgs_per_s"] = round(rate)
        channel_conn = pika.BlockingConnection(pika.URLParameters(rabbit.url))
        channel_conn.channel().queue_purge(QUEUE)
        channel_conn.close()
        for n in (1, 2, 4):
            results[f"relay_{n}_events_per_s"] = round(relay_rate(
                pg.url, rabbit.url, args.events, n, plain=False, batch_size=args.batch_size,
                tag=f"r{n}"))
        results["plain_commit_1_events_per_s"] = round(relay_rate(
            pg.url, rabbit.url, args.events, 1, plain=True, batch_size=args.batch_size,
            tag="plain"))
    c = results["ceiling_msgs_per_s"]
    results["ratios"] = {
        "relay_1_vs_ceiling": round(results["relay_1_events_per_s"] / c, 2),
        "relay_4_vs_ceiling": round(results["relay_4_events_per_s"] / c, 2),
        "2pc_vs_plain_commit": round(results["relay_1_events_per_s"]
                                     / results["plain_commit_1_events_per_s"], 2),
    }
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
