"""A consumer process for tests/integration/test_inbox.py: consumes a queue through the inbox
until it is idle for a second, printing ``<outcome> <message_id>`` per delivery, and can SIGKILL
itself at a chosen message: in the handler after its effect (before the commit), or after the
commit (before the ack).

    python -m tests.integration.inbox_consumer DB_URL AMQP_URL QUEUE INBOX EFFECTS [MODE ID]
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import pika
import psycopg
from psycopg import sql

from outbox_relay import Inbox, InboxMessage


def main(argv: list[str]) -> int:
    db_url, amqp_url, queue, inbox_table, effects = argv[:5]
    mode, crash_id = (argv[5], argv[6]) if len(argv) > 5 else ("none", "")
    inbox = Inbox(inbox_table, consumer="test")
    insert = sql.SQL("INSERT INTO {} (message_id) VALUES (%s)").format(sql.Identifier(effects))

    def handler(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        conn.execute(insert, (message.message_id,))
        if mode == "in_handler" and message.message_id == crash_id:
            os.kill(os.getpid(), signal.SIGKILL)  # the effect is written, not committed

    with psycopg.connect(db_url, autocommit=True) as db:
        connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
        channel = connection.channel()
        channel.basic_qos(prefetch_count=1)
        for method, properties, body in channel.consume(queue, inactivity_timeout=1.0):
            if method is None:
                break
            if mode == "after_commit" and properties.message_id == crash_id:
                outcome = inbox.process(db, InboxMessage.from_pika(method, properties, body),
                                        handler)
                os.kill(os.getpid(), signal.SIGKILL)  # committed, not acked
            else:
                outcome = inbox.handle_pika(db, channel, method, properties, body, handler)
            print(f"{outcome.value if outcome else 'failed'} {properties.message_id}", flush=True)
        connection.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
