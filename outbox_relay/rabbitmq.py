"""RabbitMQ plumbing both programs run on: connecting to a node (or a cluster's), the ledger's
declaration, pumping pika's I/O with our own terminator, bounded closes and coalesced writes.

Every use of pika's private names is fenced in outbox_relay.pika_private."""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pika
import pika.exceptions

from outbox_relay import pika_private
from outbox_relay.errors import StartupCheckError, TransientError, first_line

log = logging.getLogger(__name__)


def amqp_urls(text: str) -> list[str]:
    """The URLs of OUTBOX_AMQP_URL: one, or a comma-separated list of a cluster's nodes.

    A comma cannot appear unencoded in one URL's user info, host or vhost (percent-encode it as
    %2C), so splitting on it is unambiguous.
    """
    return [part.strip() for part in text.split(",")]


# Errors that mean "the connection is gone or unusable": reconnect and try again.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    pika.exceptions.AMQPConnectionError,
    pika.exceptions.ConnectionClosed,
    pika.exceptions.StreamLostError,
    pika.exceptions.ChannelWrongStateError,
    # A connection attempt that times out (a black-holed broker) raises these, not the above.
    pika_private.AMQPConnectorException,
    ConnectionError,
    OSError,
)


def connection_parameters(url: str, *, timeout: float, name: str) -> list[Any]:
    """pika's parameters for each URL of ``url`` (one, or a cluster's comma-separated list), in
    a random order: relays spread over the nodes, and a dead node costs each connection one
    refused attempt (or one ``timeout`` when black-holed), not the whole connection."""
    every = []
    for one in amqp_urls(url):
        params = pika.URLParameters(one)
        params.socket_timeout = timeout
        params.stack_timeout = timeout
        params.blocked_connection_timeout = max(timeout, 30.0)
        params.connection_attempts = 1
        params.client_properties = {"connection_name": name}
        every.append(params)
    random.shuffle(every)
    return every


def connect(url: str, *, timeout: float, name: str) -> Any:
    """A BlockingConnection to the first node of ``url`` that answers; a failure to connect is
    a TransientError without the URL's password."""
    params = connection_parameters(url, timeout=timeout, name=name)
    try:
        return pika.BlockingConnection(params if len(params) > 1 else params[0])
    except pika.exceptions.ProbableAuthenticationError as exc:
        raise StartupCheckError("RabbitMQ refused the credentials of OUTBOX_AMQP_URL") from exc
    except CONNECTION_ERRORS as exc:
        raise TransientError(f"cannot connect to RabbitMQ: {_reason(exc)}") from exc


def _reason(exc: BaseException) -> str:
    """The error's class and first line ("SSLCertVerificationError: [SSL: CERTIFICATE_VERIFY_FAILED]
    certificate verify failed ..."); pika's texts name hosts and ports, never the password."""
    text = first_line(str(exc))[:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# Replicas of the ledger stream on a cluster: one per node given, three at most (RabbitMQ's
# advice for streams and quorum queues: more replicas cost writes, not safety).
MAX_LEDGER_REPLICAS = 3
_CURRENT_SIZE_RE = re.compile(r"current is (?:the value )?'(\d+)'")


def ledger_replicas(url: str) -> int:
    """The ledger's ``x-initial-cluster-size``: the number of nodes OUTBOX_AMQP_URL names,
    three at most; 1 (no argument) for a single node."""
    return min(len(amqp_urls(url)), MAX_LEDGER_REPLICAS)


def ledger_arguments(max_age: str, replicas: int) -> dict[str, Any]:
    arguments: dict[str, Any] = {"x-queue-type": "stream", "x-max-age": max_age}
    if replicas > 1:
        arguments["x-initial-cluster-size"] = replicas
    return arguments


def declare_ledger(channel: Any, stream: str, max_age: str, *, replicas: int = 1,
                   reopen: Callable[[], Any] | None = None) -> None:
    """Declare the ledger: the stream, an exchange of the same name and the binding between them.

    Records go through the ledger's own exchange, so the relays and the resolver need no write
    permission on the default exchange (a producer row addressed to the ledger is dead-lettered
    either way). A name the broker refuses (403) or that clashes with an existing queue or
    exchange (406) is a startup error; a stream whose home node is still recovering (404) is not.

    ``replicas`` > 1 (a cluster): the stream is created with that ``x-initial-cluster-size``.
    An existing stream declared with another size is used as it is (``reopen`` gives a new
    channel for the second declaration: a refused one closes the channel), unless it was made
    with a single replica: the node holding it would then be a single point of loss of every
    record, and that is a startup error.
    """
    step = "stream"
    try:
        try:
            channel.queue_declare(queue=stream, durable=True,
                                  arguments=ledger_arguments(max_age, replicas))
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code != 406 or "x-initial-cluster-size" not in exc.reply_text:
                raise
            found = _CURRENT_SIZE_RE.search(exc.reply_text)
            # None: declared without a size, which RabbitMQ replicates to every node the
            # cluster had then (a stream made before the cluster was formed has one replica
            # that AMQP cannot show: rabbitmq-streams stream_status can).
            current = int(found.group(1)) if found else None
            if replicas > 1 and current == 1:
                raise StartupCheckError(
                    f"ledger stream {stream!r} exists with a single replica "
                    f"(x-initial-cluster-size 1) on a cluster of {len_text(replicas)} nodes: "
                    "losing its node loses the ledger; add replicas (rabbitmq-streams "
                    "add_replica) or set a new OUTBOX_LEDGER_STREAM") from exc
            if reopen is None:
                raise
            channel = reopen()
            channel.queue_declare(queue=stream, durable=True,
                                  arguments=ledger_arguments(max_age, current or 1))
        step = "exchange"
        channel.exchange_declare(exchange=stream, exchange_type="direct", durable=True)
        step = "binding"
        channel.queue_bind(queue=stream, exchange=stream, routing_key=stream)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code == 406:  # PRECONDITION_FAILED: the name is taken by another queue
            raise StartupCheckError(
                f"ledger {step} {stream!r} cannot be declared ({exc.reply_text}): a queue or "
                "exchange of that name exists with other arguments; set OUTBOX_LEDGER_STREAM"
            ) from exc
        if exc.reply_code == 403:  # ACCESS_REFUSED: retrying cannot help
            raise StartupCheckError(
                f"RabbitMQ refused the ledger {step} {stream!r} ({exc.reply_text}): give this "
                "user configure, write and read permission on it, or set OUTBOX_LEDGER_STREAM"
            ) from exc
        # E.g. 404 "home node ... is down" while a restarted broker recovers its queues.
        raise TransientError(f"ledger stream not available yet: {exc.reply_code}") from exc


def len_text(replicas: int) -> str:
    return f"{replicas}" if replicas < MAX_LEDGER_REPLICAS else f"{replicas} or more"


def pump(conn: Any, done: Callable[[], bool], timeout: float) -> None:
    """Process I/O until ``done()`` or ``timeout`` seconds, waking on every frame.

    ``process_data_events(time_limit)`` only wakes for BlockingChannel events and would sleep
    through the whole limit while confirms arrive on the asynchronous core, so this drives the
    same loop with our own terminator.
    """
    if done():
        return
    pika_private.flush_output(conn, done, timeout)
    # Deliver callbacks the blocking layer queued meanwhile (consumer messages, timers).
    conn.process_data_events(time_limit=0)


def close(conn: Any, timeout: float) -> None:
    """Close ``conn`` within ``timeout`` seconds: the AMQP handshake if the broker answers in
    time, else drop the socket.

    pika's ``BlockingConnection.close()`` waits for Channel.CloseOk and Connection.CloseOk
    without a limit, so a black-holed broker would hold the relay (and the prepared batch it
    must roll back) until the black hole ends. ``timeout`` 0 drops the socket at once.
    """
    impl = pika_private.async_connection(conn)
    try:
        if timeout > 0 and impl.is_open:
            impl.close(200, "Normal shutdown")
            pika_private.run_until(impl, lambda: bool(impl.is_closed), timeout)
        if not impl.is_closed:
            # No handshake: abort the transport; pika then reports the stream as lost.
            pika_private.terminate_stream(
                impl, pika.exceptions.StreamLostError("closed by the relay"))
            pika_private.run_until(impl, lambda: bool(impl.is_closed), 1.0)
    except Exception:  # the connection is being dropped: nothing here is worth raising
        log.debug("error while closing a RabbitMQ connection", exc_info=True,
                  extra={"action": "amqp_close_failed"})


# Writes handed to the socket at once: small frames are joined up to COALESCE_BYTES; a large
# frame (a body frame of a big message) goes as it is, so the transport's buffer holds pika's
# frames themselves instead of a joined copy of a whole batch.
COALESCE_BYTES = 1 << 20
LARGE_FRAME_BYTES = 1 << 16


@contextmanager
def coalesced_writes(conn: Any) -> Iterator[None]:
    """Within the block, hand the frames pika emits to the socket in few writes.

    pika gives each frame (three per message) to its transport separately, and the transport
    sends each with a send() system call of its own: profiled, that was the largest share of
    the relay's CPU time. The same bytes go out in the same order, only in fewer system calls,
    and never more than COALESCE_BYTES are copied into one write. Nothing inside the block may
    process I/O (publishing does not).
    """
    impl = pika_private.async_connection(conn)
    chunks: list[bytes] = []
    size = 0

    def flush() -> None:
        nonlocal size
        if chunks and pika_private.has_transport(impl):
            emit(chunks[0] if len(chunks) == 1 else b"".join(chunks))
        chunks.clear()
        size = 0

    def collect(data: bytes) -> None:
        nonlocal size
        if len(data) >= LARGE_FRAME_BYTES:
            flush()
            if pika_private.has_transport(impl):
                emit(data)
            return
        chunks.append(data)
        size += len(data)
        if size >= COALESCE_BYTES:
            flush()

    emit = pika_private.emit_hook(impl, collect)  # for this block only
    try:
        yield
    finally:
        pika_private.unhook_emit(impl)
        flush()
