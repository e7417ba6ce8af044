"""Coalesced writes: the frames pika emits in a block leave in one write, same bytes, same order."""

from __future__ import annotations

from typing import Any

import pika
import pytest
from pika import frame, spec

from outbox_relay.rabbitmq import coalesced_writes


class _Impl:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self._transport: Any = object()

    def _adapter_emit_data(self, data: bytes) -> None:
        self.writes.append(data)


class _Conn:
    def __init__(self) -> None:
        self._impl = _Impl()


def _frames(n: int) -> list[bytes]:
    props = pika.BasicProperties(delivery_mode=2, message_id=f"m{n}")
    return [frame.Method(1, spec.Basic.Publish(exchange="x", routing_key="k",
                                               mandatory=True)).marshal(),
            frame.Header(1, 3, props).marshal(), frame.Body(1, b"abc").marshal()]


def test_frames_of_a_block_leave_in_one_write_in_order() -> None:
    conn = _Conn()
    expected = [f for n in range(3) for f in _frames(n)]
    with coalesced_writes(conn):
        for data in expected:
            conn._impl._adapter_emit_data(data)
        assert conn._impl.writes == []
    assert conn._impl.writes == [b"".join(expected)]
    conn._impl._adapter_emit_data(b"after")  # the method is back: written at once
    assert conn._impl.writes[-1] == b"after"


def test_an_error_inside_the_block_still_writes_what_was_emitted() -> None:
    conn = _Conn()
    with pytest.raises(RuntimeError), coalesced_writes(conn):
        conn._impl._adapter_emit_data(b"one")
        raise RuntimeError("publish failed")
    assert conn._impl.writes == [b"one"]


def test_nothing_is_written_to_a_closed_transport() -> None:
    conn = _Conn()
    with coalesced_writes(conn):
        conn._impl._adapter_emit_data(b"one")
        conn._impl._transport = None
    assert conn._impl.writes == []


def test_large_frames_go_as_they_are_and_joins_stay_bounded() -> None:
    from outbox_relay import rabbitmq

    conn = _Conn()
    small = [b"s" * 1000 for _ in range(3000)]  # 3 MB of small frames
    big = b"B" * (rabbitmq.LARGE_FRAME_BYTES + 1)
    with coalesced_writes(conn):
        for data in small[:10]:
            conn._impl._adapter_emit_data(data)
        conn._impl._adapter_emit_data(big)
        for data in small[10:]:
            conn._impl._adapter_emit_data(data)
    writes = conn._impl.writes
    assert b"".join(writes) == b"".join(small[:10]) + big + b"".join(small[10:])
    assert writes[1] is big  # not copied into a join
    assert max(len(w) for w in writes if w is not big) <= rabbitmq.COALESCE_BYTES + 1000
    assert len(writes) <= 6
