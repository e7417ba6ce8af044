"""A steady producer and a timing consumer, each in a process of its own.

The producer commits events at a fixed offered rate, a small transaction every 5 ms (plain
INSERTs, no NOTIFY), and notes when each transaction's COMMIT returned. The consumer notes when
each event arrives at the sink. Both use CLOCK_MONOTONIC, which is one clock for every process
on Linux, so receipt minus commit is the end-to-end latency. Separate processes, so neither
waits for the other's GIL and the relay under test is a third process.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from array import array
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import pika
import psycopg

from benchmarks.workload import DeliveryError, Servers, insert_events, outbox_rows, queue_names

TICK = 0.005
_SPAWN = mp.get_context("spawn")  # fresh interpreters: no inherited state, honest memory

@dataclass
class Produced:
    """Commit time of every event: ``commit_at[seq]``, sequences 0 .. count-1."""

    commit_at: array[float]

    @property
    def count(self) -> int:
        return len(self.commit_at)


def _produce(db_url: str, prefix: str, rate: float, seconds: float, queues: int,
             out: Connection) -> None:
    commit_at = array("d")
    with psycopg.connect(db_url, autocommit=True) as conn:
        out.send("ready")
        started = time.monotonic()
        tick = 0
        while (now := time.monotonic()) - started < seconds:
            due = int(rate * (now - started)) + 1
            if due > len(commit_at):
                lo = len(commit_at)
                # Autocommit: this one statement is the transaction; it has committed on return.
                insert_events(conn, prefix, lo, due - 1, queues)
                committed = time.monotonic()
                commit_at.extend([committed] * (due - lo))
            tick += 1
            time.sleep(max(0.0, started + tick * TICK - time.monotonic()))
    out.send(commit_at.tobytes())


class Producer:
    """Offers ``rate`` events/s for ``seconds``; ids are ``<prefix>-<seq>``."""

    def __init__(self, servers: Servers, prefix: str, rate: float, seconds: float) -> None:
        self._pipe, child = _SPAWN.Pipe()
        self._proc = _SPAWN.Process(target=_produce, args=(servers.db_url, prefix, rate, seconds,
                                                           servers.sink_queues, child), daemon=True)
        self._proc.start()
        if self._pipe.recv() != "ready":
            raise RuntimeError("producer failed to start")

    def result(self) -> Produced:
        commit_at = array("d")
        commit_at.frombytes(self._pipe.recv())
        self._proc.join(10)
        return Produced(commit_at)


@dataclass
class Received:
    """Arrival time of each event by sequence (0.0: not arrived), copies, foreign ids."""

    arrived_at: array[float]
    duplicates: int
    unexpected: int

    def at(self, seq: int) -> float:
        return self.arrived_at[seq] if seq < len(self.arrived_at) else 0.0

    def check_exactly_once(self, produced: int, db_url: str, what: str) -> None:
        """Events 0 .. produced-1 each arrived once, nothing else did, the outbox is empty."""
        missing = sum(1 for seq in range(produced) if not self.at(seq))
        if missing or self.duplicates or self.unexpected or outbox_rows(db_url):
            raise DeliveryError(f"{what}: {missing} lost, {self.duplicates} duplicates, "
                                f"{self.unexpected} unexpected, {outbox_rows(db_url)} left")


def _consume(amqp_url: str, queues: list[str], prefix: str, ctrl: Connection) -> None:
    arrived = array("d")
    counts = {"duplicates": 0, "unexpected": 0}
    head = prefix + "-"

    def on_message(_ch: Any, _method: Any, props: Any, _body: bytes) -> None:
        now = time.monotonic()
        message_id = props.message_id or ""
        if not message_id.startswith(head) or not message_id[len(head):].isdigit():
            counts["unexpected"] += 1
            return
        seq = int(message_id[len(head):])
        if seq >= len(arrived):
            arrived.extend(bytes(8 * (seq + 4096 - len(arrived))))  # zeros: not arrived
        if arrived[seq]:
            counts["duplicates"] += 1
        else:
            arrived[seq] = now

    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    channel = conn.channel()
    channel.basic_qos(prefetch_count=1000)
    for queue in queues:
        channel.basic_consume(queue, on_message, auto_ack=True)
    ctrl.send("ready")
    while True:
        conn.process_data_events(time_limit=0.01)
        if ctrl.poll():
            command = ctrl.recv()
            ctrl.send((arrived.tobytes(), counts["duplicates"], counts["unexpected"]))
            if command == "stop":
                break
    conn.close()


class Consumer:
    """Consumes the sink (auto-ack) and times every ``<prefix>-<seq>`` arrival."""

    def __init__(self, servers: Servers, prefix: str) -> None:
        self._pipe, child = _SPAWN.Pipe()
        self._proc = _SPAWN.Process(
            target=_consume, args=(servers.amqp_url, queue_names(servers.sink_queues), prefix, child),
            daemon=True)
        self._proc.start()
        if self._pipe.recv() != "ready":
            raise RuntimeError("consumer failed to start")

    def snapshot(self) -> Received:
        return self._ask("snapshot")

    def stop(self) -> Received:
        received = self._ask("stop")
        self._proc.join(10)
        return received

    def wait_for(self, seqs: range | list[int], timeout: float) -> Received:
        """Poll until every one of ``seqs`` arrived (or the timeout passed)."""
        deadline = time.monotonic() + timeout
        # A snapshot copies every arrival time: ask less often when there are many.
        interval = max(0.02, len(seqs) / 2_000_000)
        while True:
            received = self.snapshot()
            if all(received.at(s) for s in seqs) or time.monotonic() > deadline:
                return received
            time.sleep(interval)

    def _ask(self, command: str) -> Received:
        self._pipe.send(command)
        raw, duplicates, unexpected = self._pipe.recv()
        arrived = array("d")
        arrived.frombytes(raw)
        return Received(arrived, duplicates, unexpected)
