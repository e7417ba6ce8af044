"""outbox-relay for the services on both ends of the relay.

Producer: add events to the outbox in your own transaction::

    from outbox_relay import enqueue

    with conn.transaction():                     # psycopg 3; or a SQLAlchemy Session, Django...
        conn.execute("UPDATE orders SET status = 'paid' WHERE id = %s", (42,))
        enqueue(conn, exchange="orders", routing_key="order.paid",
                payload={"order_id": 42}, ordering_key="order-42")

    await enqueue_async(aconn, ...)              # an asyncio connection or session

Consumer: apply each event once, although the relay delivers at least once::

    from outbox_relay import Inbox

    inbox = Inbox("inbox", consumer="billing")
    channel.basic_consume("billing.orders", inbox.pika_callback(db, apply_payment))

A service's unit tests can record events without a database: ``outbox_relay.testing``
(``RecordingOutbox``, imported from there only).

The implementation lives in ``outbox_relay.producer`` and ``outbox_relay.inbox``; this package
is the one import a service needs, and it loads neither program (``outbox_relay.relay``,
``outbox_relay.resolver``) nor pika. SQLAlchemy and aio-pika are optional (extras ``sqlalchemy`` and
``aio-pika``): nothing here imports them. Nor OpenTelemetry (extra ``otel``), which
``outbox_relay.tracing`` uses only in a process that imported it itself, nor prometheus-client,
which the inbox's metrics need (``outbox_relay.inbox_metrics``, opt-in).
"""

from outbox_relay.errors import ConfigError, InboxError, InvalidEvent, NotInTransaction, OutboxError
from outbox_relay.inbox import (
    DEFAULT_RETENTION_SECONDS,
    AsyncHandler,
    Handler,
    Inbox,
    InboxMessage,
    OnError,
    Outcome,
    inbox_schema_sql,
)
from outbox_relay.producer import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Enqueueing,
    Event,
    JsonDefault,
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
    schema_sql,
)
from outbox_relay.rules import ORDERING_KEY_HEADER, POSITION_HEADER
from outbox_relay.version import __version__

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_RETENTION_SECONDS",
    "ORDERING_KEY_HEADER",
    "POSITION_HEADER",
    "AsyncHandler",
    "ConfigError",
    "Enqueueing",
    "Event",
    "Handler",
    "Inbox",
    "InboxError",
    "InboxMessage",
    "InvalidEvent",
    "JsonDefault",
    "NotInTransaction",
    "OnError",
    "OutboxError",
    "Outcome",
    "__version__",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
    "inbox_schema_sql",
    "schema_sql",
]
