"""The contract of outbox_relay/pika_private.py: every private pika name it uses exists in the pika
installed, which is in the range pyproject.toml pins. A pika release that renames or drops one
fails here, by name, before any relay runs on it (the integration tests exercise the behaviour)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pika
import pika.channel
import pika.connection
from pika.adapters import base_connection, blocking_connection
from pika.adapters.utils import connection_workflow

ROOT = Path(__file__).resolve().parents[2]


def assigns(cls: type, attribute: str) -> bool:
    """``cls.__init__`` (or a method it names) sets ``self.<attribute>``."""
    source = inspect.getsource(cls)
    return re.search(rf"self\.{attribute}\b\s*(:[^=]*)?=", source) is not None


def test_the_blocking_layer_keeps_its_asynchronous_core() -> None:
    assert assigns(blocking_connection.BlockingConnection, "_impl")
    assert assigns(blocking_connection.BlockingChannel, "_impl")
    assert callable(blocking_connection.BlockingConnection._flush_output)
    timer = blocking_connection._IoloopTimerContext
    assert callable(timer.__enter__) and callable(timer.is_ready)
    assert list(inspect.signature(timer.__init__).parameters) == ["self", "duration", "connection"]


def test_the_asynchronous_connection_keeps_what_close_and_coalesced_writes_use() -> None:
    assert callable(pika.connection.Connection._terminate_stream)
    assert callable(base_connection.BaseConnection._adapter_emit_data)
    assert assigns(base_connection.BaseConnection, "_transport")
    assert assigns(pika.connection.Connection, "params")


def test_the_channel_keeps_its_no_ack_consumers() -> None:
    assert assigns(pika.channel.Channel, "_consumers_with_noack")


def test_the_channel_keeps_its_content_assembler() -> None:
    """bound_bodies replaces it with a subclass that drops the frames of a big body."""
    assembler = pika.channel.ContentFrameAssembler
    assert assigns(pika.channel.Channel, "_content_assembler")
    for attribute in ("_method_frame", "_header_frame", "_seen_so_far", "_body_fragments"):
        assert assigns(assembler, attribute), attribute
    assert callable(assembler._handle_body_frame) and callable(assembler._reset)
    assert list(inspect.signature(assembler.__init__).parameters) == ["self"]


def test_the_table_decoder_looks_its_value_decoder_up_by_name() -> None:
    """tolerate_out_of_range_fields replaces pika.data.decode_value: the table and array
    decoders must call it through the module's globals."""
    import pika.data

    from outbox_relay import pika_private

    original = pika_private._PIKA_DECODE_VALUE  # pika's own, whether replaced yet or not
    assert original.__module__ == "pika.data" and original.__name__ == "decode_value"
    assert "decode_value(encoded, offset)" in inspect.getsource(pika.data.decode_table)
    assert "decode_value(encoded, offset)" in inspect.getsource(original)  # arrays


def test_a_connection_attempt_that_times_out_still_raises_this() -> None:
    assert issubclass(connection_workflow.AMQPConnectorException, Exception)


def test_the_installed_pika_is_in_the_pinned_range() -> None:
    pin = re.search(r'"pika>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text("utf-8"))
    assert pin, "pyproject.toml pins pika as pika>=LOW,<HIGH"
    low, high = pin.groups()

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split(".")[:3])

    assert version(low) <= version(pika.__version__) < version(high), pin.group(0)
