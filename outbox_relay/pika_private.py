"""Every use of pika's private names, fenced in one module.

pika's blocking layer waits one round trip per confirmed publish; the relay drives pika's
asynchronous core under it instead (many confirms in flight), bounds closes a black-holed broker
never answers, batches socket writes and closes stream consumers without basic.reject. That needs
names pika does not promise to keep. They are used only here, and
tests/unit/test_pika_private.py fails loudly on a pika release that renames or drops any of
them; pyproject.toml pins the range tested. pika ships no type hints and the stubs published for
it (types-pika, pika-stubs) describe pika 1.2 at best: pika objects are ``Any`` here.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import pika.channel
import pika.data
import pika.exceptions
from pika.adapters.blocking_connection import _IoloopTimerContext

# A connection attempt that times out raises this, not an AMQPConnectionError.
from pika.adapters.utils.connection_workflow import AMQPConnectorException

__all__ = ["AMQPConnectorException", "DroppedBody", "async_channel", "async_connection",
           "bound_bodies", "connection_user", "emit_hook", "flush_output", "frame_max",
           "has_transport", "mark_no_ack", "run_until", "terminate_stream",
           "tolerate_out_of_range_fields", "unhook_emit"]


def async_connection(blocking: Any) -> Any:
    """The asynchronous ``pika.connection.Connection`` under a ``BlockingConnection``."""
    return blocking._impl


def async_channel(blocking: Any) -> Any:
    """The asynchronous ``pika.channel.Channel`` under a ``BlockingChannel``."""
    return blocking._impl


def frame_max(blocking: Any, default: int) -> int:
    """The frame_max negotiated with the broker (after Connection.Tune)."""
    return int(getattr(blocking._impl.params, "frame_max", default))


def connection_user(blocking: Any) -> str | None:
    """The user name the connection authenticated with: that of the node's URL (pika's
    default, guest, for a URL without one), or None for credentials without a name (EXTERNAL).
    With a cluster's URLs, the one of the node that answered."""
    username = getattr(blocking._impl.params.credentials, "username", None)
    return username if isinstance(username, str) else None


def flush_output(blocking: Any, done: Callable[[], bool], timeout: float) -> None:
    """Run the blocking connection's I/O loop until ``done()`` or ``timeout`` seconds, waking
    on every frame (``process_data_events`` sleeps through confirms of the asynchronous core)."""
    with _IoloopTimerContext(timeout, blocking._impl) as timer:
        blocking._flush_output(timer.is_ready, done)


def run_until(impl: Any, done: Callable[[], bool], timeout: float) -> None:
    """Run an asynchronous connection's I/O loop until ``done()`` or ``timeout``, whatever its
    write buffer holds."""
    with _IoloopTimerContext(timeout, impl) as timer:
        while not done() and not timer.is_ready():
            impl.ioloop.poll()
            impl.ioloop.process_timeouts()


def terminate_stream(impl: Any, error: BaseException) -> None:
    """Drop the socket without the AMQP close handshake; pika reports ``error`` as the cause."""
    impl._terminate_stream(error)


def has_transport(impl: Any) -> bool:
    return impl._transport is not None


def emit_hook(impl: Any, collect: Callable[[bytes], None]) -> Callable[[bytes], None]:
    """Route the frames ``impl`` writes to ``collect``; returns pika's own writer."""
    emit: Callable[[bytes], None] = impl._adapter_emit_data
    impl._adapter_emit_data = collect  # an instance attribute shadows the method
    return emit


def unhook_emit(impl: Any) -> None:
    del impl._adapter_emit_data


def mark_no_ack(channel: Any, consumer_tag: str) -> None:
    """Have pika take ``consumer_tag`` for a no-ack consumer, so cancelling it rejects nothing."""
    channel._consumers_with_noack.add(consumer_tag)


# AMQP field values pika decodes into a Python type that cannot hold every value the wire can:
# a timestamp ('T', seconds) into a datetime (the year 10000 on raises ValueError), a float or
# double into an int (NaN and infinities raise). Their type octet and width.
_NUMBERS = {b"T": (">Q", 8), b"f": (">f", 4), b"d": (">d", 8)}
_PIKA_DECODE_VALUE = pika.data.decode_value


def _decode_value(encoded: bytes, offset: int) -> tuple[Any, int]:
    try:
        return _PIKA_DECODE_VALUE(encoded, offset)  # type: ignore[no-any-return]
    except (ValueError, OverflowError, OSError):
        kind = encoded[offset:offset + 1]
        if kind not in _NUMBERS:
            raise
        fmt, width = _NUMBERS[kind]
        return struct.unpack_from(fmt, encoded, offset + 1)[0], offset + 1 + width


def tolerate_out_of_range_fields() -> None:
    """Have pika decode a header value it cannot represent as its raw number, not raise.

    pika decodes a message's headers with the frame, at the connection's level: a header
    timestamp past the year 9999 (RabbitMQ keeps it through a stream) raised ValueError there,
    and the whole connection was lost. Any user of the vhost can append such a message to the
    ledger stream, and every ledger read then failed on it (issue 32). pika's table decoder
    looks ``decode_value`` up as a module global, nested tables and arrays included, so this
    replaces it for the process; in-range values decode as before.
    """
    pika.data.decode_value = _decode_value


class DroppedBody(bytes):
    """The (empty) body pika delivers for a message over ``bound_bodies``' limit; ``size`` is
    the size the message had."""

    size: int = 0


class _BoundedAssembler(pika.channel.ContentFrameAssembler):  # type: ignore[misc]
    """pika's assembler of a message's frames, keeping no body frame of a message over
    ``limit`` bytes: it counts them and delivers a DroppedBody."""

    def __init__(self, limit: int, taking_over: Any) -> None:
        super().__init__()
        self._limit = limit
        # A message the channel's own assembler had begun: frames of a channel closed just
        # before, under the same number, can still arrive while the new one opens.
        for name in _ASSEMBLY:
            setattr(self, name, getattr(taking_over, name))

    def _handle_body_frame(self, body_frame: Any) -> Any:
        if self._header_frame is None or self._header_frame.body_size <= self._limit:
            return super()._handle_body_frame(body_frame)  # pika's own, whatever it does
        size = self._header_frame.body_size
        self._seen_so_far += len(body_frame.fragment)  # the fragment itself is dropped
        if self._seen_so_far < size:
            return None
        if self._seen_so_far > size:
            raise pika.exceptions.BodyTooLongError(self._seen_so_far, size)
        dropped = DroppedBody()
        dropped.size = size
        content = (self._method_frame, self._header_frame, dropped)
        self._reset()
        return content


def bound_bodies(channel: Any, limit: int) -> None:
    """Have the asynchronous ``channel`` keep at most ``limit`` bytes of any message body.

    pika joins a message's body frames in memory before it delivers the message: one ledger
    record of 100 MiB cost the resolver that twice over, whatever it then did with it. Past
    ``limit``, each body frame (at most frame_max bytes) is dropped as it arrives and the
    message is delivered with a DroppedBody.
    """
    channel._content_assembler = _BoundedAssembler(limit, channel._content_assembler)


# What a ContentFrameAssembler knows of the message it is assembling.
_ASSEMBLY = ("_method_frame", "_header_frame", "_seen_so_far", "_body_fragments")
