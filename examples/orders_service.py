"""Example producer service, "orders": each payment updates the order row and enqueues an
``order.paid`` event, in one transaction of the service's own database.

Either both happen or neither: the relay (a sidecar reading the outbox table) publishes the
event to RabbitMQ only once the transaction has committed. The consumer side of this example is
examples/billing_service.py.

    python examples/orders_service.py --database-url postgresql://... --payments 100

Settings are flags or environment variables (``--help``). It prints the message id of every
payment it committed, one a line, as soon as the transaction has committed.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

import psycopg

import outbox_relay

EXCHANGE = "orders"
ROUTING_KEY = "order.paid"

SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
    id       bigint PRIMARY KEY,
    paid     numeric NOT NULL DEFAULT 0,
    payments integer NOT NULL DEFAULT 0
)
"""


def setup(conn: psycopg.Connection[Any], *, orders: int, outbox_table: str = "outbox") -> None:
    """The service's own table and the outbox (idempotent), and ``orders`` unpaid orders."""
    with conn.transaction():
        conn.execute(outbox_relay.schema_sql(outbox_table))  # or `outbox-relay migrate`
        conn.execute(SCHEMA)
        conn.execute("INSERT INTO orders (id) SELECT generate_series(1, %s) "
                     "ON CONFLICT (id) DO NOTHING", (orders,))


def pay(conn: psycopg.Connection[Any], order_id: int, amount: Decimal, *,
        exchange: str = EXCHANGE, outbox_table: str = "outbox") -> str:
    """Record a payment and enqueue its event in one transaction; the event's message id."""
    with conn.transaction():
        # Locking the order row serializes the payments of one order, so their events get
        # outbox ids (their position, header x-outbox-id) in the order they were paid.
        row = conn.execute(
            "UPDATE orders SET paid = paid + %s, payments = payments + 1 WHERE id = %s "
            "RETURNING payments", (amount, order_id)).fetchone()
        if row is None:
            raise LookupError(f"no order {order_id}")
        return outbox_relay.enqueue(
            conn, exchange=exchange, routing_key=ROUTING_KEY,
            payload={"order_id": order_id, "amount": str(amount), "payment": row[0]},
            ordering_key=f"order-{order_id}", table=outbox_table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orders_service.py", description=__doc__.split("\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("ORDERS_DATABASE_URL"),
                        help="the orders database [env ORDERS_DATABASE_URL]")
    parser.add_argument("--outbox-table", default=os.environ.get("ORDERS_OUTBOX_TABLE", "outbox"))
    parser.add_argument("--exchange", default=os.environ.get("ORDERS_EXCHANGE", EXCHANGE))
    parser.add_argument("--orders", type=int, default=20, help="orders to pay into (default 20)")
    parser.add_argument("--payments", type=int, default=100, help="payments to make (default 100)")
    parser.add_argument("--rate", type=float, default=0, help="payments per second (0: at once)")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("--database-url (or ORDERS_DATABASE_URL) is required")
    rng = random.Random(args.seed)
    with psycopg.connect(args.database_url) as conn:
        setup(conn, orders=args.orders, outbox_table=args.outbox_table)
        started = time.monotonic()
        for n in range(args.payments):
            amount = Decimal(rng.randrange(100, 10_000)) / 100
            message_id = pay(conn, rng.randrange(1, args.orders + 1), amount,
                             exchange=args.exchange, outbox_table=args.outbox_table)
            print(message_id, flush=True)
            if args.rate > 0:
                time.sleep(max(0.0, started + (n + 1) / args.rate - time.monotonic()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
