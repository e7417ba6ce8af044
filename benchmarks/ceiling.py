"""The ceiling: the rate one bare pika publisher gets into this broker at all.

Same body size, persistent, ``mandatory``, a message id and a timestamp like the relay's, to
the same exchange and queue, publisher confirms with a sliding window: up to ``window``
messages unconfirmed, the next ones written as soon as confirms come back. It uses pika's
asynchronous channel core under a blocking connection, as the relay does; nothing else runs.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import pika
import pika.spec

from benchmarks.cpu import CpuMeter
from benchmarks.workload import CEILING_BODY, EXCHANGE, ROUTING_KEY, Servers, purge_sink
from relay import amqp


@dataclass
class CeilingRun:
    count: int
    window: int
    seconds: float
    cpu_seconds: dict[str, float]  # publisher, rabbitmq

    @property
    def rate(self) -> float:
        return self.count / self.seconds


def publish_rate(servers: Servers, count: int, window: int, *, coalesce: bool = True) -> CeilingRun:
    """Publish ``count`` messages with at most ``window`` unconfirmed.

    ``coalesce=False`` lets pika write frame by frame (a send() each), as it does by default.
    """
    purge_sink(servers.amqp_url)
    meter = CpuMeter({"rabbitmq": servers.rabbitmq_pids})
    conn = pika.BlockingConnection(pika.URLParameters(servers.amqp_url))
    try:
        channel = conn.channel()._impl
        state = {"confirmed": 0, "nacked": 0, "returned": 0, "low_water": 0}
        selected: list[bool] = []

        def on_confirm(frame: Any) -> None:
            method = frame.method
            if isinstance(method, pika.spec.Basic.Nack):
                state["nacked"] += 1
            # Tags are sequential and confirmed in order: the highest is the count so far.
            state["confirmed"] = max(state["confirmed"], method.delivery_tag)

        def on_return(*_args: Any) -> None:
            state["returned"] += 1

        channel.confirm_delivery(ack_nack_callback=on_confirm,
                                 callback=lambda _frame: selected.append(True))
        channel.add_on_return_callback(on_return)
        amqp.pump(conn, lambda: bool(selected), 10)
        sent = 0
        meter.start()
        cpu_start = time.process_time()
        started = time.perf_counter()
        while state["confirmed"] < count:
            # The relay's own way of writing a batch: one write, not a send() per frame.
            with amqp.coalesced_writes(conn) if coalesce else contextlib.nullcontext():
                while sent < min(count, state["confirmed"] + window):
                    sent += 1
                    props = pika.BasicProperties(delivery_mode=2, content_type="application/json",
                                                 message_id=f"ceiling-{sent}",
                                                 timestamp=int(time.time()))
                    channel.basic_publish(EXCHANGE, ROUTING_KEY, CEILING_BODY, props,
                                          mandatory=True)
            # Refill once half the window is back (or wait for the last confirm).
            state["low_water"] = sent if sent == count else sent - window // 2
            amqp.pump(conn, lambda: state["confirmed"] >= state["low_water"], 60)
            if state["confirmed"] < state["low_water"]:
                raise RuntimeError("the broker stopped confirming")
        seconds = time.perf_counter() - started
        cpu = {"publisher": round(time.process_time() - cpu_start, 3), **meter.stop()}
    finally:
        conn.close()
    if state["nacked"] or state["returned"]:
        raise RuntimeError(f"ceiling run refused by the broker: {state}")
    return CeilingRun(count, window, seconds, cpu)
