"""The FastStream recipe of docs/python-api.md ("FastStream"), with the names a test gives it:
a subscriber that applies each event once through the inbox and acks (or nacks) the message
only after the inbox's transaction has ended. tests/integration/test_faststream.py runs it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from faststream import AckPolicy, FastStream
from faststream.rabbit import Channel, ExchangeType, RabbitBroker, RabbitExchange, RabbitQueue
from faststream.rabbit.annotations import RabbitMessage
from psycopg_pool import AsyncConnectionPool

from outbox_relay import Inbox, InboxMessage, Outcome

Handler = Callable[[psycopg.AsyncConnection[Any], InboxMessage], Awaitable[object]]


def make_app(database_url: str, amqp_url: str, *, exchange: str, queue: str, binding: str,
             dead_letter_queue: str, inbox: Inbox, handler: Handler, prefetch: int = 8,
             outcomes: list[Outcome | None] | None = None) -> FastStream:
    """The recipe's app. ``outcomes``: a list that gets each delivery's outcome (None: the
    handler raised, or no database connection), for the test to wait on."""
    broker = RabbitBroker(amqp_url)
    app = FastStream(broker)
    # One connection per message in flight: the channel's prefetch bounds them.
    pool = AsyncConnectionPool(database_url, min_size=1, max_size=prefetch, open=False,
                               timeout=5.0, kwargs={"autocommit": True})

    @app.on_startup
    async def open_pool() -> None:
        await pool.open()

    @app.after_shutdown
    async def close_pool() -> None:
        await pool.close()

    @broker.subscriber(
        RabbitQueue(queue, durable=True, routing_key=binding, arguments={
            "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead_letter_queue}),
        RabbitExchange(exchange, type=ExchangeType.TOPIC, durable=True),
        ack_policy=AckPolicy.MANUAL,  # the inbox acks, after its commit
        channel=Channel(prefetch_count=prefetch),
    )
    async def on_event(message: RabbitMessage) -> None:
        outcome = None
        try:
            async with pool.connection() as conn:
                outcome = await inbox.handle_aio_pika(conn, message.raw_message, handler)
        finally:
            if not message.raw_message.processed:  # no database connection: back to the queue
                await message.raw_message.nack(requeue=True)
            if outcomes is not None:
                outcomes.append(outcome)

    return app
