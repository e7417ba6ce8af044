"""The resolver's side of the ledger: append a marker, read until it comes back. pika's
connection errors stop at this edge (TransientError)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime

from relay import amqp, ledger
from relay.errors import BatchFailed, TransientError
from relay.publisher import AmqpPublisher


class AmqpLedger:
    """The ``Ledger`` of resolver/worker.py, on one RabbitMQ connection."""

    def __init__(self, url: str, *, stream: str, max_age: str, read_timeout: float,
                 connect_timeout: float) -> None:
        self._stream = stream
        self._read_timeout = read_timeout
        self._amqp = AmqpPublisher(url, ledger_stream=stream, ledger_max_age=max_age,
                                   confirm_timeout=read_timeout, connect_timeout=connect_timeout,
                                   name="outbox-resolver")

    @property
    def connected(self) -> bool:
        return self._amqp.connected

    def connect(self) -> None:
        """Connect and declare the ledger (a name clash is a StartupCheckError)."""
        self._amqp.connect()

    def close(self) -> None:
        self._amqp.close()

    def committed(self, key: bytes, since: datetime, candidates: Mapping[str, ledger.Expected], *,
                  on_progress: Callable[[], None],
                  on_rejected: Callable[[ledger.Rejected], None]) -> dict[str, int]:
        """{gid: message count} of the candidates with an authentic record from ``since`` up to a
        marker appended now: everything published before this call has been read."""
        marker = ledger.new_marker()
        try:
            self._amqp.append_ledger(ledger.marker_record(key, marker), message_id=marker)
        except BatchFailed as exc:
            raise TransientError(str(exc)) from exc
        try:
            return ledger.read_until_marker(
                self._amqp.connection, self._stream, since, marker, key=key,
                candidates=candidates, idle_timeout=self._read_timeout, on_progress=on_progress,
                on_rejected=on_rejected)
        except amqp.CONNECTION_ERRORS as exc:
            raise TransientError(f"RabbitMQ connection lost reading the ledger: {exc!r}") from exc
