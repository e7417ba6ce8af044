"""The example service pair end to end (examples/orders_service.py -> relays -> RabbitMQ ->
examples/billing_service.py), against real servers, while relays are SIGKILLed (one of them
right after its batch was confirmed, so the broker certainly delivers duplicates), the billing
consumer is SIGKILLed, and the connections of relays, resolver and consumer are cut.

Counted, not assumed: every payment the orders service committed is applied exactly once in the
billing database (one ``payments`` row per message id, the balances equal to the orders'), and
the broker delivered copies (the total-queue checker on a second queue bound to the same
exchange counts them; the consumer says it acked copies as duplicates)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from devenv import checker
from devenv.proxy import Proxy
from tests.conftest import ROOT, Env
from tests.fix_proxy import ProxyFactory
from tests.integration.test_pipeline import log_of, wait_until

EXAMPLES = ROOT / "examples"
ORDERS = 30
FIRST_PAYMENTS = 100
PAYMENTS = 600
RATE = 80  # payments a second after the first ones: about 6 s of faults while producing
BATCH = 20


def database_url(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


@pytest.fixture
def databases(env: Env) -> Iterator[tuple[str, str]]:
    """The orders service's database and the billing service's: each service its own."""
    names = [f"orders_{env.gid_prefix}", f"billing_{env.gid_prefix}"]
    with env.connect() as conn:
        for name in names:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield database_url(env.db_url, names[0]), database_url(env.db_url, names[1])
    for proc in env.processes:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    with psycopg.connect(database_url(env.db_url, names[0]), autocommit=True) as conn:
        for (gid,) in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE database = "
                                   "current_database()").fetchall():
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
    with env.connect() as conn:
        for name in names:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


def scalar(url: str, query: str) -> Any:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(query).fetchone()
        return row[0] if row else None


def test_the_example_services_apply_every_payment_exactly_once_through_kills_and_cuts(
        env: Env, databases: tuple[str, str], proxies: ProxyFactory) -> None:
    orders_url, billing_url = databases
    rng = random.Random(12)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    billing_out = logs / f"{env.gid_prefix}-billing.out"
    billing_queue = f"billing.{env.gid_prefix}"
    relay_pg, relay_mq = proxies(orders_url), proxies(env.amqp_url)
    billing_pg, billing_mq = proxies(billing_url), proxies(env.amqp_url)

    def spawn(program: str, **extra: str) -> subprocess.Popen[bytes]:
        settings = {"OUTBOX_DATABASE_URL": relay_pg.url(orders_url),
                    "OUTBOX_AMQP_URL": relay_mq.url(env.amqp_url), "OUTBOX_TABLE": "outbox",
                    "OUTBOX_BATCH_SIZE": str(BATCH), "OUTBOX_POLL_MIN_INTERVAL": "0.02",
                    "OUTBOX_CONFIRM_TIMEOUT": "2", "OUTBOX_CONNECT_TIMEOUT": "2",
                    "OUTBOX_RECONNECT_MAX_DELAY": "1", "OUTBOX_RESOLVER_INTERVAL": "0.3"}
        settings.update(extra)
        return env.spawn(program, **settings)

    def spawn_billing() -> subprocess.Popen[bytes]:
        with open(billing_out, "ab") as out, open(f"{billing_out}.log", "ab") as err:
            proc = subprocess.Popen(
                [sys.executable, str(EXAMPLES / "billing_service.py")], cwd=ROOT, stdout=out,
                stderr=err, env=env.cli_env(
                    BILLING_DATABASE_URL=billing_pg.url(billing_url),
                    BILLING_AMQP_URL=billing_mq.url(env.amqp_url),
                    BILLING_EXCHANGE=env.exchange, BILLING_QUEUE=billing_queue))
        env.processes.append(proc)
        return proc

    def orders(payments: int, *extra: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, str(EXAMPLES / "orders_service.py"), "--database-url", orders_url,
             "--exchange", env.exchange, "--orders", str(ORDERS), "--payments", str(payments),
             *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env.cli_env())
        env.processes.append(proc)  # type: ignore[arg-type]
        return proc

    def billing_lines(outcome: str) -> int:
        text = billing_out.read_text() if billing_out.exists() else ""
        return sum(1 for line in text.splitlines() if line.startswith(outcome + " "))

    # 1. The consumer first (it declares and binds its queue), then the first payments.
    billing = spawn_billing()
    wait_until(lambda: billing_out.exists() and "consuming" in billing_out.read_text(), 30,
               "the billing service to consume")
    first = orders(FIRST_PAYMENTS, "--seed", "1")
    out, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    produced = out.split()

    # 2. A relay that dies right after the broker confirmed its first batch: the resolver rolls
    # the batch back and it is published again: the broker certainly delivers duplicates.
    crashing = spawn("relay", OUTBOX_TEST_CRASH_AT="after_publish")
    assert crashing.wait(30) == -9, log_of(crashing)

    # 3. The resolver, two relays, more payments, and faults all along.
    spawn("resolver")
    relays = [spawn("relay") for _ in range(2)]
    rest = orders(PAYMENTS - FIRST_PAYMENTS, "--seed", "2", "--rate", str(RATE))
    cuts: dict[str, Proxy] = {"cut relay postgresql": relay_pg, "cut relay rabbitmq": relay_mq,
                              "cut billing postgresql": billing_pg,
                              "cut billing rabbitmq": billing_mq}
    faults = ["kill relay", "kill billing", *cuts]
    done: list[str] = []
    started = time.monotonic()
    while rest.poll() is None or len(done) < 2 * len(faults):
        assert time.monotonic() - started < 60, "the orders service took too long"
        time.sleep(rng.uniform(0.4, 0.8))
        fault = faults[len(done) % len(faults)]
        if fault == "kill relay":
            i = rng.randrange(len(relays))
            relays[i].kill()
            relays[i].wait()
            relays[i] = spawn("relay")
        elif fault == "kill billing":
            billing.kill()
            billing.wait()
            billing = spawn_billing()
        else:
            cuts[fault].cut()
        done.append(fault)
    out, err = rest.communicate(timeout=30)
    assert rest.returncode == 0, err
    produced += out.split()
    assert len(produced) == len(set(produced)) == PAYMENTS

    # 4. Everything is relayed, nothing left in doubt, every payment applied.
    wait_until(lambda: scalar(orders_url, "SELECT count(*) FROM outbox") == 0
               and scalar(orders_url, "SELECT count(*) FROM pg_prepared_xacts WHERE "
                                      "database = current_database()") == 0,
               90, "the relays and the resolver to publish everything")
    wait_until(lambda: scalar(billing_url, "SELECT count(DISTINCT message_id) FROM payments")
               == PAYMENTS, 90, "the billing service to apply every payment")
    time.sleep(1)  # late copies still in the queue are acked as duplicates, never applied
    assert billing.poll() is None, Path(f"{billing_out}.log").read_text()[-3000:]
    billing.terminate()
    assert billing.wait(30) == 0, Path(f"{billing_out}.log").read_text()[-3000:]

    # Exactly once, counted: one payments row per message id, and the balances agree.
    with psycopg.connect(billing_url) as conn:
        applied = dict(conn.execute(
            "SELECT message_id, count(*) FROM payments GROUP BY message_id").fetchall())
        balances = sorted(conn.execute("SELECT order_id, paid, payments FROM order_balances"))
    assert set(applied) == set(produced)
    assert set(applied.values()) == {1}, {m: n for m, n in applied.items() if n > 1}
    with psycopg.connect(orders_url) as conn:
        expected = sorted(conn.execute(
            "SELECT id, paid, payments FROM orders WHERE payments > 0").fetchall())
    assert balances == expected

    # Although the broker delivered duplicates: counted on a second queue bound to the same
    # exchange (the total-queue checker), and by the consumer, which acked copies unapplied.
    deliveries = checker.drain(env.amqp_url, env.queue, expected=set(produced), idle_timeout=1)
    with psycopg.connect(orders_url, autocommit=True) as conn:
        report = checker.check(produced, deliveries, conn=conn, table="outbox",
                               gid_prefix=env.gid_prefix)
    assert report.lost == [] and report.unexpected == [], report.summary()
    assert report.left_in_outbox == report.in_doubt == report.dead_lettered == 0
    assert report.duplicates >= 1, report.summary()
    assert billing_lines("duplicate") >= 1
    assert sorted(set(done)) == sorted(faults)

    connection, channel = env.amqp_channel()
    channel.queue_delete(billing_queue)
    connection.close()
