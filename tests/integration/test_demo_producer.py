"""The docker-compose demo producer and consumer (deploy/demo/) against the real servers: the
producer makes its events routable, inserts them steadily with plain INSERTs, stops on SIGTERM,
the relay delivers every one of them to the demo queue, and the consumer shows them arriving,
dropping copies by message_id."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pika
import pika.exceptions

from tests.conftest import ROOT, Env
from tests.integration.test_pipeline import log_of, outbox_count, stop, wait_until

PRODUCER = ROOT / "deploy" / "demo" / "producer.py"


def queue_depth(env: Env, queue: str) -> int:
    conn, channel = env.amqp_channel()
    try:
        return int(channel.queue_declare(queue, passive=True).method.message_count)
    finally:
        conn.close()


def test_demo_producer_feeds_the_relay_until_sigterm(env: Env) -> None:
    exchange, queue = f"demo.{env.gid_prefix}", f"demo.events.{env.gid_prefix}"
    producer = subprocess.Popen(
        [sys.executable, str(PRODUCER)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=env.cli_env(DEMO_EXCHANGE=exchange, DEMO_QUEUE=queue, DEMO_RATE="100",
                        OUTBOX_LOG_FORMAT="json"))
    try:
        wait_until(lambda: producer.poll() is not None or outbox_count(env) >= 30, 30,
                   "the producer to insert events")
        started = time.monotonic()
        count_then = outbox_count(env)
        time.sleep(1)
        # Steady: about DEMO_RATE a second, not a burst.
        rate = (outbox_count(env) - count_then) / (time.monotonic() - started)
        assert 50 <= rate <= 130, rate
        producer.send_signal(signal.SIGTERM)
        out, err = producer.communicate(timeout=10)
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()
    assert producer.returncode == 0, err
    produced = json.loads(out.decode().strip().splitlines()[-1])["produced"]
    assert produced == outbox_count(env) >= 30
    actions = [json.loads(line)["action"] for line in err.decode().splitlines()]
    assert actions[0] == "demo_topology_declared" and actions[-1] == "demo_producer_stopped"

    relay = env.spawn("relay")
    try:
        wait_until(lambda: outbox_count(env) == 0, 30, "the relay to publish the demo events")
        assert stop(relay) == 0, log_of(relay)
        # Routable: every event reached the demo queue (none returned, none dead-lettered).
        wait_until(lambda: queue_depth(env, queue) == produced, 10, "the demo queue to fill")
    finally:
        conn, channel = env.amqp_channel()
        try:
            channel.queue_delete(queue)
            channel.exchange_delete(exchange)
        except pika.exceptions.AMQPError:
            pass
        conn.close()


def test_demo_producer_stops_after_demo_events_and_refuses_bad_settings(env: Env) -> None:
    exchange, queue = f"demo.{env.gid_prefix}", f"demo.events.{env.gid_prefix}"
    base = env.cli_env(DEMO_EXCHANGE=exchange, DEMO_QUEUE=queue)
    try:
        done = subprocess.run([sys.executable, str(PRODUCER), "--events", "7", "--rate", "500"],
                              cwd=ROOT, env=base, capture_output=True, timeout=30)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["produced"] == 7 == outbox_count(env)
    finally:
        conn, channel = env.amqp_channel()
        channel.queue_delete(queue)
        channel.exchange_delete(exchange)
        conn.close()
    bad = subprocess.run([sys.executable, str(PRODUCER)], cwd=ROOT, capture_output=True,
                         env={**base, "DEMO_RATE": "0"}, timeout=30)
    assert bad.returncode == 2
    assert "DEMO_RATE must be a positive number" in bad.stderr.decode()


CONSUMER = ROOT / "deploy" / "demo" / "consumer.py"


def test_demo_consumer_shows_the_relayed_events_and_drops_copies(env: Env) -> None:
    exchange, queue = f"demo.{env.gid_prefix}", f"demo.events.{env.gid_prefix}"
    base = env.cli_env(DEMO_EXCHANGE=exchange, DEMO_QUEUE=queue, OUTBOX_LOG_FORMAT="json")
    try:
        # The consumer waits for the queue the producer declares.
        consumer = subprocess.Popen([sys.executable, str(CONSUMER), "--events", "20"], cwd=ROOT,
                                    env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        done = subprocess.run([sys.executable, str(PRODUCER), "--events", "20", "--rate", "500"],
                              cwd=ROOT, env=base, capture_output=True, timeout=30)
        assert done.returncode == 0, done.stderr
        relay = env.spawn("relay")
        try:
            out, err = consumer.communicate(timeout=60)
        finally:
            assert stop(relay) == 0, log_of(relay)
        assert consumer.returncode == 0, err
        assert json.loads(out) == {"received": 20, "duplicates": 0}
        actions = [json.loads(line)["action"] for line in err.decode().splitlines()]
        assert actions[0] == "demo_consumer_started" and actions[-1] == "demo_events_consumed"

        # Copies of one message_id (as after a relay's crash) are dropped, and acked.
        conn, channel = env.amqp_channel()
        try:
            for message_id in ("m1", "m1", "m2", "m2", "m2", "m3"):
                channel.basic_publish("", queue, b"{}", pika.BasicProperties(message_id=message_id))
        finally:
            conn.close()
        again = subprocess.run([sys.executable, str(CONSUMER), "--events", "3"], cwd=ROOT,
                               env=base, capture_output=True, timeout=60)
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout) == {"received": 3, "duplicates": 3}
        assert queue_depth(env, queue) == 0
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.wait()
        conn, channel = env.amqp_channel()
        channel.queue_delete(queue)
        channel.exchange_delete(exchange)
        conn.close()


def test_demo_consumer_refuses_bad_settings(env: Env) -> None:
    bad = subprocess.run([sys.executable, str(CONSUMER)], cwd=ROOT, capture_output=True,
                         env=env.cli_env(DEMO_SEEN_LIMIT="0"), timeout=30)
    assert bad.returncode == 2
    assert "DEMO_SEEN_LIMIT must be a positive integer" in bad.stderr.decode()
