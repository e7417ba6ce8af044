"""What OUTBOX_STANDBY_WAIT costs: ``python -m devenv.standby_cost``.

A PostgreSQL primary with an asynchronous streaming standby and one RabbitMQ node. For each
batch size, the same number of events is relayed by one relay without the wait and with
OUTBOX_STANDBY_WAIT=standby (each on a fresh table, in alternating rounds); the figure is the
time from the relay's start until the outbox is empty, as events per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pika
import psycopg

from devenv import checker
from devenv.servers import PostgresPair, RabbitServer
from outbox_relay.schema import migrate

ROOT = Path(__file__).resolve().parent.parent


def relay_once(pair: PostgresPair, rabbit: RabbitServer, table: str, events: int, batch: int,
               wait: str) -> float:
    migrate(pair.url, table)
    conn = pika.BlockingConnection(pika.URLParameters(rabbit.url))
    channel = conn.channel()
    channel.exchange_declare("cost", exchange_type="topic", durable=True)
    channel.queue_declare("cost", durable=True)
    channel.queue_bind("cost", "cost", routing_key="#")
    conn.close()
    with psycopg.connect(pair.url, autocommit=True) as db:
        checker.insert_events(db, table, events, exchange="cost", routing_key="cost")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update({"OUTBOX_DATABASE_URL": pair.url, "OUTBOX_AMQP_URL": rabbit.url,
                "OUTBOX_TABLE": table, "OUTBOX_GID_PREFIX": table.replace("_", "-"),
                "OUTBOX_BATCH_SIZE": str(batch), "OUTBOX_METRICS_PORT": "0",
                "OUTBOX_STANDBY_WAIT": wait, "PYTHONPATH": str(ROOT)})
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "outbox_relay.relay"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with psycopg.connect(pair.url, autocommit=True) as db:
            while True:
                row = db.execute(f"SELECT count(*) FROM {table}").fetchone()
                if row is not None and row[0] == 0:
                    break
                time.sleep(0.02)
        return events / (time.monotonic() - started)
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devenv.standby_cost", description=__doc__)
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[2000, 100])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    results: dict[str, dict[str, float]] = {}
    with PostgresPair(sync=False) as pair, RabbitServer() as rabbit:
        n = 0
        for batch in args.batch_sizes:
            rates: dict[str, list[float]] = {"off": [], "standby": []}
            for _ in range(args.rounds):
                for wait in ("", "standby"):
                    n += 1
                    rate = relay_once(pair, rabbit, f"cost_{n}", args.events, batch, wait)
                    rates[wait or "off"].append(rate)
            off, on = statistics.median(rates["off"]), statistics.median(rates["standby"])
            results[f"batch_{batch}"] = {"off_events_per_s": round(off),
                                         "standby_wait_events_per_s": round(on),
                                         "cost_percent": round(100 * (1 - on / off), 1)}
            print(f"batch {batch}: off {off:,.0f} events/s, OUTBOX_STANDBY_WAIT {on:,.0f} "
                  f"events/s ({100 * (1 - on / off):.1f} % less)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"events": args.events, "rounds": args.rounds,
                                         "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
