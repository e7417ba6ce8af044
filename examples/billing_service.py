"""Example consumer service, "billing": applies the ``order.paid`` events of
examples/orders_service.py to its own database through the inbox, so each payment is counted
once although RabbitMQ may deliver an event more than once.

    python examples/billing_service.py --database-url postgresql://.../billing \\
        --amqp-url amqp://guest:guest@localhost:5672/%2F

The handler's effect (a row in ``payments``, the order's balance) and the inbox's record of the
message id commit in one transaction of the billing database; the message is acked after that
commit. It declares its queue (bound to the orders exchange) and consumes it until SIGTERM;
a lost connection to PostgreSQL or RabbitMQ is retried. It prints one line per delivery:
``applied <message_id>``, ``duplicate <message_id>`` or ``failed <message_id>``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from decimal import Decimal
from types import FrameType
from typing import Any

import pika
import pika.exceptions
import psycopg

import outbox_relay

SCHEMA = """
-- No unique key on message_id on purpose: the inbox is what keeps a payment from being
-- counted twice (and the example's test counts the rows per message id).
CREATE TABLE IF NOT EXISTS payments (
    message_id text NOT NULL,
    order_id   bigint NOT NULL,
    amount     numeric NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS order_balances (
    order_id bigint PRIMARY KEY,
    paid     numeric NOT NULL,
    payments integer NOT NULL
);
"""

inbox = outbox_relay.Inbox("inbox", consumer="billing")


def apply_payment(conn: psycopg.Connection[Any], message: outbox_relay.InboxMessage) -> None:
    """The handler: runs once per message id, inside the inbox's transaction. No commit here."""
    event = message.json()
    amount = Decimal(event["amount"])
    conn.execute("INSERT INTO payments (message_id, order_id, amount) VALUES (%s, %s, %s)",
                 (message.message_id, event["order_id"], amount))
    conn.execute(
        "INSERT INTO order_balances AS b (order_id, paid, payments) VALUES (%s, %s, 1) "
        "ON CONFLICT (order_id) DO UPDATE SET paid = b.paid + excluded.paid, "
        "payments = b.payments + 1", (event["order_id"], amount))


def setup(conn: psycopg.Connection[Any]) -> None:
    inbox.migrate(conn)  # or `outbox-inbox migrate`
    with conn.transaction():
        conn.execute(SCHEMA)


class Stop(Exception):
    """SIGTERM: leave the consume loop; the unacked message (if any) goes back to the queue."""


def consume(database_url: str, amqp_url: str, *, exchange: str, queue: str,
            prefetch: int) -> None:
    """Consume until Stop; a lost connection ends this with the error (the caller retries)."""
    with psycopg.connect(database_url, autocommit=True, connect_timeout=5,
                         application_name="billing") as db:
        setup(db)
        params = pika.URLParameters(amqp_url)
        params.connection_attempts = 1
        mq = pika.BlockingConnection(params)
        try:
            channel = mq.channel()
            channel.exchange_declare(exchange, exchange_type="topic", durable=True)
            channel.queue_declare(queue, durable=True)
            channel.queue_bind(queue, exchange, routing_key="order.paid")
            channel.basic_qos(prefetch_count=prefetch)

            def on_message(ch: Any, method: Any, properties: Any, body: bytes) -> None:
                outcome = inbox.handle_pika(db, ch, method, properties, body, apply_payment,
                                            on_error=outbox_relay.OnError.REQUEUE_ONCE)
                shown = outcome.value if outcome is not None else "failed"
                print(f"{shown} {properties.message_id}", flush=True)

            channel.basic_consume(queue, on_message)
            print("consuming", flush=True)
            channel.start_consuming()
        finally:
            if mq.is_open:
                with contextlib.suppress(pika.exceptions.AMQPError):
                    mq.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="billing_service.py", description=__doc__.split("\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("BILLING_DATABASE_URL"),
                        help="the billing database [env BILLING_DATABASE_URL]")
    parser.add_argument("--amqp-url", default=os.environ.get("BILLING_AMQP_URL"),
                        help="RabbitMQ [env BILLING_AMQP_URL]")
    parser.add_argument("--exchange", default=os.environ.get("BILLING_EXCHANGE", "orders"))
    parser.add_argument("--queue", default=os.environ.get("BILLING_QUEUE", "billing.orders"))
    parser.add_argument("--prefetch", type=int, default=50)
    args = parser.parse_args(argv)
    if not args.database_url or not args.amqp_url:
        parser.error("--database-url and --amqp-url (or their environment variables) are required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    logging.getLogger("pika").setLevel(logging.WARNING)

    def on_sigterm(_signum: int, _frame: FrameType | None) -> None:
        raise Stop

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        while True:
            try:
                consume(args.database_url, args.amqp_url, exchange=args.exchange,
                        queue=args.queue, prefetch=args.prefetch)
            except (psycopg.Error, pika.exceptions.AMQPError, OSError) as exc:
                logging.warning("connection lost (%s: %s); reconnecting",
                                type(exc).__name__, exc)
                time.sleep(0.5)
    except Stop:
        return 0


if __name__ == "__main__":
    sys.exit(main())
