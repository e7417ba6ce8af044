"""Fixtures: real PostgreSQL (2PC on) and RabbitMQ, started from the installed binaries.

Set OUTBOX_TEST_DATABASE_URL and OUTBOX_TEST_AMQP_URL to use running servers instead (the
PostgreSQL one needs max_prepared_transactions > 0). OUTBOX_TEST_PG picks the PostgreSQL that
every server the tests start runs (a major version or a bin directory: devenv.servers.pg_bindir).
A server that cannot be started or reached fails the tests that need it: nothing here ever skips.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import psycopg
import pytest
from psycopg import sql

from devenv import checker, launch
from devenv.servers import PG_CHOICE_ENV, PostgresServer, RabbitServer, ServerError, pg_bindir, pg_version
from outbox_relay.relay.settings import RelaySettings
from outbox_relay.resolver.settings import ResolverSettings
from outbox_relay.runtime import backoff
from outbox_relay.schema import migrate
from outbox_relay.tables import Tables

pytest_plugins = ["tests.fix_proxy"]

ROOT = Path(__file__).resolve().parent.parent


def package_sources() -> list[Path]:
    """The installed package's Python files, each once by its real path: outbox_relay/ without
    its links, and the folders they link to (relay/, resolver/, sql/)."""
    found = []
    for folder in ("outbox_relay", "relay", "resolver", "sql"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if not any(p.is_symlink() for p in path.relative_to(ROOT).parents if p != Path(".")):
                found.append(path)
    return found

# Reconnect backoff shrunk for tests (psycopg_pool style).
backoff.INITIAL_DELAY = 0.05


def pytest_report_header() -> list[str]:
    """Which PostgreSQL the servers the tests start run, so a run's log says what it tested."""
    choice = os.environ.get(PG_CHOICE_ENV, "")
    try:
        bindir = pg_bindir()
        line = f"PostgreSQL {pg_version(bindir)} from {bindir}"
    except ServerError as exc:  # the tests that start a server fail with the same message
        line = f"PostgreSQL: {exc}"
    if choice:
        line += f" ({PG_CHOICE_ENV}={choice})"
    if os.environ.get("OUTBOX_TEST_DATABASE_URL"):
        line += "; the shared server is OUTBOX_TEST_DATABASE_URL's"
    return [line]


@dataclass
class External:
    """A server the caller runs; it cannot be killed or restarted by the tests."""

    url: str


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer | External]:
    url = os.environ.get("OUTBOX_TEST_DATABASE_URL")
    if url:
        yield External(url)
        return
    with PostgresServer(max_prepared_transactions=64) as server:
        yield server


@pytest.fixture(scope="session")
def rabbit_server() -> Iterator[RabbitServer | External]:
    url = os.environ.get("OUTBOX_TEST_AMQP_URL")
    if url:
        yield External(url)
        return
    with RabbitServer() as server:
        yield server


@dataclass
class Env:
    """One test's isolated corner of the shared servers: its own tables, prefix, stream, queue."""

    db_url: str
    amqp_url: str
    table: str
    gid_prefix: str
    ledger_stream: str
    exchange: str
    queue: str
    routing_key: str = "event.created"
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def relay_settings(self, **overrides: Any) -> RelaySettings:
        values: dict[str, Any] = dict(
            database_url=self.db_url, amqp_url=self.amqp_url, table=self.table,
            gid_prefix=self.gid_prefix, ledger_stream=self.ledger_stream, metrics_port=0,
            retry_base_delay=0.05, retry_max_delay=0.2, confirm_timeout=10,
        )
        values.update(overrides)
        return RelaySettings(**values)

    def resolver_settings(self, **overrides: Any) -> ResolverSettings:
        values: dict[str, Any] = dict(
            database_url=self.db_url, amqp_url=self.amqp_url, table=self.table,
            gid_prefix=self.gid_prefix, ledger_stream=self.ledger_stream, metrics_port=0,
            ledger_margin=60, interval=0.2,
        )
        values.update(overrides)
        return ResolverSettings(**values)

    def cli_env(self, **extra: str) -> dict[str, str]:
        return launch.program_env(self.db_url, self.amqp_url, **{
            "OUTBOX_TABLE": self.table, "OUTBOX_GID_PREFIX": self.gid_prefix,
            "OUTBOX_LEDGER_STREAM": self.ledger_stream, "OUTBOX_RETRY_BASE_DELAY": "0.05",
            "OUTBOX_RETRY_MAX_DELAY": "0.2", **extra})

    def spawn(self, program: str, *args: str, **extra_env: str) -> subprocess.Popen[bytes]:
        """Run ``python -m relay|resolver`` as a real process (its stderr to a log file)."""
        log_path = (Path(os.environ.get("TMPDIR", "/tmp"))
                    / f"{self.gid_prefix}-{program}-{len(self.processes)}.log")
        proc = launch.launch(program, self.cli_env(**extra_env), log_path, *args)
        proc.log_path = str(log_path)  # type: ignore[attr-defined]
        self.processes.append(proc)
        return proc

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.db_url, autocommit=True)

    def drain_and_check(self, produced: list[str], *, early: Sequence[checker.Delivery] = (),
                        idle_timeout: float = 2.0) -> checker.Report:
        """Drain the test's queue until every produced id not already in ``early`` arrived, and
        run the total-queue checker, counting what is left in the outbox, dead-lettered and in
        doubt under the test's table and gid prefix."""
        rest = set(produced) - {d.message_id for d in early}
        deliveries = [*early, *checker.drain(self.amqp_url, self.queue, expected=rest,
                                             idle_timeout=idle_timeout)]
        with self.connect() as conn:
            return checker.check(produced, deliveries, conn=conn, table=self.table,
                                 gid_prefix=self.gid_prefix)

    def amqp_channel(self) -> tuple[Any, Any]:
        # A cluster's comma-separated URLs: the first node that answers.
        conn = pika.BlockingConnection([pika.URLParameters(u) for u in self.amqp_url.split(",")])
        return conn, conn.channel()


def server_url(server: PostgresServer | RabbitServer | External) -> str:
    return server.url


def make_env(db_url: str, amqp_url: str, tag: str = "t", *,
             queue_arguments: dict[str, Any] | None = None) -> Env:
    """A fresh corner of the servers: migrated table, exchange and bound queue, unique names
    (``queue_arguments``: e.g. a quorum queue on a cluster)."""
    uid = secrets.token_hex(4)
    e = Env(
        db_url=db_url, amqp_url=amqp_url, table=f"outbox_{tag}{uid}", gid_prefix=f"{tag}{uid}",
        ledger_stream=f"test.ledger.{uid}", exchange=f"test.events.{uid}",
        queue=f"test.sink.{uid}",
    )
    migrate(e.db_url, e.table)
    conn, channel = e.amqp_channel()
    channel.exchange_declare(e.exchange, exchange_type="topic", durable=True)
    channel.queue_declare(e.queue, durable=True, arguments=queue_arguments)
    channel.queue_bind(e.queue, e.exchange, routing_key="#")
    conn.close()
    return e


def finish_env(e: Env, *, drop: bool = True) -> None:
    """Kill what the test left running; drop its tables, queues and prepared transactions."""
    for proc in e.processes:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    if drop:
        _drop(e)


@pytest.fixture
def env(pg_server: PostgresServer | External,
        rabbit_server: RabbitServer | External) -> Iterator[Env]:
    e = make_env(server_url(pg_server), server_url(rabbit_server))
    yield e
    finish_env(e)


def _drop(e: Env) -> None:
    with psycopg.connect(e.db_url, autocommit=True) as conn:
        for (gid,) in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE starts_with(gid, %s)",
                                   (e.gid_prefix + ":",)).fetchall():
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        tables = Tables(e.table)
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}, {}, {}").format(
            tables.outbox, tables.dead_letter, tables.ledger_key))
    try:
        conn2, channel = e.amqp_channel()
        for queue in (e.queue, e.ledger_stream):
            channel.queue_delete(queue)
        for exchange in (e.exchange, e.ledger_stream):
            channel.exchange_delete(exchange)
        conn2.close()
    except pika.exceptions.AMQPError:
        pass
