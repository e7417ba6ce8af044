"""The ceiling: the rate one bare pika publisher gets into this broker at all.

Same body size, persistent, ``mandatory``, a message id and a timestamp like the relay's, to
the same exchange and queue, publisher confirms with a sliding window: up to ``window``
messages unconfirmed, the next ones written as soon as confirms come back. It uses pika's
asynchronous channel core under a blocking connection, as the relay does; nothing else runs.
``parallel_rate`` runs several such publishers, each a process of its own, into the same queue:
whether more connections get more in says whether the publisher or the broker is the limit.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import pika
import pika.spec

from benchmarks import processes
from benchmarks.cpu import CpuMeter
from benchmarks.workload import (
    CEILING_BODY,
    EXCHANGE,
    ROUTING_PREFIX,
    Servers,
    SinkDrainer,
    purge_sink,
)
from outbox_relay import pika_private, rabbitmq


@dataclass
class CeilingRun:
    count: int
    window: int
    seconds: float
    cpu_seconds: dict[str, float]  # publisher(s), rabbitmq

    @property
    def rate(self) -> float:
        return self.count / self.seconds


class _Publisher:
    """One connection, one confirm-mode channel, a sliding window of unconfirmed messages."""

    def __init__(self, amqp_url: str) -> None:
        self.conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
        self.channel = pika_private.async_channel(self.conn.channel())
        self.state = {"confirmed": 0, "nacked": 0, "returned": 0, "low_water": 0}
        selected: list[bool] = []
        self.channel.confirm_delivery(ack_nack_callback=self._on_confirm,
                                      callback=lambda _frame: selected.append(True))
        self.channel.add_on_return_callback(self._on_return)
        rabbitmq.pump(self.conn, lambda: bool(selected), 10)

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        if isinstance(method, pika.spec.Basic.Nack):
            self.state["nacked"] += 1
        # Tags are sequential and confirmed in order: the highest is the count so far.
        self.state["confirmed"] = max(self.state["confirmed"], method.delivery_tag)

    def _on_return(self, *_args: Any) -> None:
        self.state["returned"] += 1

    def run(self, count: int, window: int, *, queues: int = 1, coalesce: bool = True,
            tag: str = "c") -> None:
        state, sent = self.state, 0
        while state["confirmed"] < count:
            # The relay's own way of writing a batch: one write, not a send() per frame.
            with rabbitmq.coalesced_writes(self.conn) if coalesce else contextlib.nullcontext():
                while sent < min(count, state["confirmed"] + window):
                    sent += 1
                    props = pika.BasicProperties(delivery_mode=2, content_type="application/json",
                                                 message_id=f"{tag}-{sent}",
                                                 timestamp=int(time.time()))
                    self.channel.basic_publish(EXCHANGE, f"{ROUTING_PREFIX}{sent % queues}",
                                               CEILING_BODY, props, mandatory=True)
            # Refill once half the window is back (or wait for the last confirm).
            state["low_water"] = sent if sent == count else sent - window // 2
            rabbitmq.pump(self.conn, lambda: state["confirmed"] >= state["low_water"], 60)
            if state["confirmed"] < state["low_water"]:
                raise RuntimeError("the broker stopped confirming")
        if state["nacked"] or state["returned"]:
            raise RuntimeError(f"ceiling run refused by the broker: {state}")

    def close(self) -> None:
        self.conn.close()


def publish_rate(servers: Servers, count: int, window: int, *, coalesce: bool = True) -> CeilingRun:
    """Publish ``count`` messages with at most ``window`` unconfirmed.

    ``coalesce=False`` lets pika write frame by frame (a send() each), as it does by default.
    """
    purge_sink(servers)
    meter = CpuMeter({"rabbitmq": servers.rabbitmq_pids})
    publisher = _Publisher(servers.amqp_url)
    drainer = SinkDrainer(servers) if servers.drained_sink else None
    try:
        if drainer is not None:
            drainer.start()
        meter.start()
        cpu_start, started = time.process_time(), time.perf_counter()
        publisher.run(count, window, queues=servers.sink_queues, coalesce=coalesce)
        seconds = time.perf_counter() - started
        cpu = {"publisher": round(time.process_time() - cpu_start, 3), **meter.stop()}
    finally:
        if drainer is not None:
            drainer.stop()
        publisher.close()
    return CeilingRun(count, window, seconds, cpu)


def _publisher_process(amqp_url: str, count: int, window: int, queues: int, tag: str,
                       ready: Any, go: Any, done: Any) -> None:
    publisher = _Publisher(amqp_url)
    ready.release()
    go.wait()
    cpu = time.process_time()
    publisher.run(count, window, queues=queues, tag=tag)
    done.put((time.monotonic(), time.process_time() - cpu))
    publisher.close()


def parallel_rate(servers: Servers, count: int, window: int, publishers: int) -> CeilingRun:
    """``publishers`` processes publish ``count`` messages between them into the same queue."""
    purge_sink(servers)
    meter = CpuMeter({"rabbitmq": servers.rabbitmq_pids})
    share = count // publishers
    started, results = processes.run_together(
        _publisher_process,
        [(servers.amqp_url, share, window, servers.sink_queues, f"p{i}") for i in range(publishers)],
        meter)
    cpu = {"publisher": round(sum(c for _t, c in results), 3), **meter.stop()}
    return CeilingRun(share * publishers, window, max(t for t, _c in results) - started, cpu)
