"""Relay throughput from a pre-filled outbox, with N relay processes.

Each process runs the relay's own protocol loop (``Relay.turn``: claim, PREPARE, publish with
pipelined confirms, ledger record, COMMIT PREPARED; the relay's pause after a short or empty
claim) until the outbox is empty. Processes connect first and wait at a start line, so the
figure is claim-to-committed of every event, not interpreter start-up. The plain-commit variant
swaps in ``PlainCommitStore`` (below): the same loop with BEGIN ... COMMIT, to price the
two-phase commit. It exists only in this benchmark.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from benchmarks.processes import run_together, status_kb
from benchmarks.profile import Profiler
from benchmarks.workload import Servers, check_exactly_once, prefill, reset
from outbox_relay.model import OutboxRow
from outbox_relay.relay.publisher import AmqpPublisher
from outbox_relay.relay.settings import RelaySettings
from outbox_relay.relay.store import BATCH_STATEMENTS_SETUP, OutboxStore
from outbox_relay.relay.worker import Relay
from outbox_relay.rules import DEFAULT_MAX_MESSAGE_BYTES


class PlainCommitStore(OutboxStore):
    """Benchmark only: each claim is committed with a plain COMMIT after its ledger record.

    No PREPARE: a batch's claim transaction stays open while it is published, and the relay
    claims the next batch meanwhile, so claims alternate between two sessions; COMMIT (or
    ROLLBACK) ends the oldest open one. The loop is otherwise the relay's own. Never a
    production option: a crash of the relay mid-batch would lose no row, but nothing would
    tell a restarted relay what the broker already has.
    """

    def connect(self, lock_class: int, instance: int) -> None:
        super().connect(lock_class, instance)
        self._sessions = [self.claim_conn, self.open_claim_session()]
        self._open: deque[psycopg.Connection[Any]] = deque()

    @property
    def claim_conn(self) -> psycopg.Connection[Any]:
        """The session of the latest claim (before connect() finishes: the store's own)."""
        return self._open[-1] if getattr(self, "_open", None) else super().claim_conn

    def claim(self, limit: int, max_bytes: int, *,
              max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
              one_row_at_least: bool = True) -> list[OutboxRow]:
        self._open.append(next(c for c in self._sessions if c not in self._open))
        return super().claim(limit, max_bytes, max_message_bytes=max_message_bytes,
                             one_row_at_least=one_row_at_least)

    def rollback(self) -> None:
        self._open.pop().execute("ROLLBACK")

    def prepare(self, gid: str) -> int:
        return 0  # no prepared transaction: its ledger record names xid 0

    def finish(self, gid: str, *, commit: bool) -> bool:
        self._open.popleft().execute("COMMIT" if commit else "ROLLBACK")
        return True

    def close(self) -> None:
        for session in getattr(self, "_sessions", []):
            session.close()
        self._sessions, self._open = [], deque()
        super().close()


@dataclass
class RelayRun:
    events: int
    processes: int
    seconds: float
    peak_rss_mb: list[float]
    cpu_seconds: dict[str, float]  # relay (all processes), postgresql, rabbitmq

    @property
    def rate(self) -> float:
        return self.events / self.seconds


def _relay_process(settings: RelaySettings, plain: bool, ready: Any, go: Any, done: Any) -> None:
    store = (PlainCommitStore if plain else OutboxStore)(settings.database_url, settings.table)
    publisher = AmqpPublisher(settings.amqp_url, ledger_stream=settings.ledger_stream,
                              ledger_max_age=settings.ledger_max_age,
                              confirm_timeout=settings.confirm_timeout,
                              connect_timeout=settings.connect_timeout)
    relay = Relay(settings, store, publisher)
    relay.ensure_connected()
    ready.release()
    go.wait()
    cpu = time.process_time()
    # The relay's own turns, with its pauses after a short or empty claim, until the outbox is
    # empty. A claim that finds nothing is not enough: the rows left may be another relay's
    # batch, or rows of keys such a batch holds (per-key order), which come free when it
    # commits; a batch in flight stays visible until then.
    while True:
        pause = relay.turn()
        if pause is None:
            continue
        if outbox_empty(store):
            break
        relay.pause(pause)
    finished, cpu = time.monotonic(), time.process_time() - cpu
    relay.close()
    # VmHWM, not ru_maxrss: the latter keeps the forking parent's peak across exec.
    done.put((finished, cpu, status_kb(os.getpid(), "VmHWM") / 1024))


def outbox_empty(store: OutboxStore) -> bool:
    """No row left in the outbox: its primary key's first entry, where the relay's stats (a
    count of the whole table) made PostgreSQL read every row after each empty claim (with 50
    keys at x4, most of its CPU)."""
    with store.conn.transaction():
        store.conn.execute(BATCH_STATEMENTS_SETUP)  # no sequential scan over the dead rows
        row = store.conn.execute(
            sql.SQL("SELECT min(id) FROM {}").format(store.tables.outbox)).fetchone()
    return row is None or row[0] is None


def relay_run(servers: Servers, events: int, processes: int, *, batch_size: int,
              plain: bool = False, tag: str, profiler: Profiler | None = None) -> RelayRun:
    """Relay ``events`` pre-filled events with ``processes`` relays; checked exactly once."""
    reset(servers)
    produced = prefill(servers, events, tag)
    settings = RelaySettings(database_url=servers.db_url, amqp_url=servers.amqp_url,
                             batch_size=batch_size, metrics_port=0)
    meter = servers.cpu_meter()
    started, results = run_together(_relay_process, [(settings, plain)] * processes, meter,
                                    profiler)
    cpu = {"relay": round(sum(c for _f, c, _r in results), 3), **meter.stop()}
    seconds = max(finished for finished, _c, _r in results) - started
    check_exactly_once(servers, produced, f"relay x{processes}{' plain' if plain else ''}")
    return RelayRun(events, processes, seconds, [round(rss, 1) for _f, _c, rss in results], cpu)
