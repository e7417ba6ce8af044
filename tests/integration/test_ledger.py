"""The ledger reader against a real stream that other relays keep appending to."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone

from relay import ledger
from relay.publisher import AmqpPublisher
from tests.conftest import Env


def publisher(env: Env, name: str) -> AmqpPublisher:
    pub = AmqpPublisher(env.amqp_url, ledger_stream=env.ledger_stream, ledger_max_age="7D",
                        confirm_timeout=10, connect_timeout=5, name=name)
    pub.connect()
    return pub


def test_reads_under_concurrent_appends_keep_the_connection(env: Env) -> None:
    """Records keep arriving after the reader's marker; ending the read must not reject them
    (a stream answers basic.reject by closing the connection), so one connection serves
    scan after scan."""
    stop = threading.Event()
    appended: list[str] = []

    def append_forever() -> None:
        pub = publisher(env, "test-ledger-writer")
        try:
            n = 0
            while not stop.is_set():
                gid = f"busy:00000001:{n}"
                pub.record_batch(gid, 1, "00000001")
                appended.append(gid)
                n += 1
        finally:
            pub.close()

    writer = threading.Thread(target=append_forever, daemon=True)
    writer.start()
    reader = publisher(env, "test-ledger-reader")
    try:
        since = datetime.now(timezone.utc) - timedelta(minutes=1)
        for _ in range(5):
            while len(appended) < 50:
                stop.wait(0.01)
            before = list(appended)
            marker = ledger.new_marker()
            reader.append_ledger(ledger.marker_record(marker), message_id=marker)
            gids = ledger.read_until_marker(reader.connection, env.ledger_stream, since,
                                            marker, 10)
            assert set(before) <= set(gids)
            assert reader.connected, "the ledger read cost the reader its connection"
            appended.clear()
    finally:
        stop.set()
        writer.join(10)
        reader.close()
