"""``outbox-relay``: run the relay (default), apply the schema (``migrate``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from relay import config, faults, logs, metrics
from relay.errors import ConfigError, OutboxError, StartupCheckError, TransientError
from relay.migrate import migrate, schema_sql
from relay.publisher import AmqpPublisher
from relay.signals import Shutdown
from relay.store import OutboxStore
from relay.worker import Relay

log = logging.getLogger("relay")

EXIT_CONFIG = 2
EXIT_STARTUP = 3

MIGRATE_OPTIONS = (config.DATABASE_URL, config.TABLE, config.CONNECT_TIMEOUT,
                   config.LOG_LEVEL, config.LOG_FORMAT)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox-relay",
        description="Relay outbox rows from PostgreSQL to RabbitMQ with two-phase commit. "
        "Every flag can also be set by the environment variable shown in its help.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{run,migrate}")
    run = sub.add_parser("run", help="relay events (the default)")
    config.add_options(run, config.RELAY_OPTIONS)
    mig = sub.add_parser("migrate", help="create the outbox tables if missing (idempotent)")
    mig.add_argument("--print", action="store_true", dest="print_only",
                     help="print the SQL instead of applying it (for psql -f)")
    config.add_options(mig, MIGRATE_OPTIONS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (args_list[0].startswith("-") and args_list[0] not in ("-h", "--help")):
        args_list.insert(0, "run")
    args = build_parser().parse_args(args_list)
    try:
        if args.command == "migrate":
            return _migrate(args)
        return _run(args)
    except ConfigError as exc:
        print(f"outbox-relay: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except StartupCheckError as exc:
        log.error("%s", exc, extra={"action": "startup_check_failed"})
        print(f"outbox-relay: error: {exc}", file=sys.stderr)
        return EXIT_STARTUP
    except TransientError as exc:
        print(f"outbox-relay: error: {exc}", file=sys.stderr)
        return 1


def _migrate(args: argparse.Namespace) -> int:
    if args.print_only:
        table = config.resolve(args, (config.TABLE,))["table"]
        sys.stdout.write(schema_sql(table) + "\n")
        return 0
    values = config.resolve(args, MIGRATE_OPTIONS)
    logs.setup(values["log_level"], values["log_format"])
    migrate(values["database_url"], values["table"], timeout=values["connect_timeout"])
    log.info("schema applied", extra={"action": "schema_applied", "table": values["table"]})
    return 0


def _run(args: argparse.Namespace) -> int:
    settings = config.RelaySettings(**config.resolve(args, config.RELAY_OPTIONS))
    try:
        fault = faults.crash_hook()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    logs.setup(settings.log_level, settings.log_format)
    shutdown = Shutdown()
    shutdown.install()
    relay_metrics = metrics.RelayMetrics()
    store = OutboxStore(settings.database_url, settings.table,
                        connect_timeout=settings.connect_timeout)
    publisher = AmqpPublisher(
        settings.amqp_url, ledger_stream=settings.ledger_stream,
        ledger_max_age=settings.ledger_max_age, confirm_timeout=settings.confirm_timeout,
        connect_timeout=settings.connect_timeout, fault=fault)
    relay = Relay(settings, store, publisher, metrics=relay_metrics, fault=fault,
                  should_stop=lambda: shutdown.requested)
    publisher.name = f"outbox-relay {relay.instance_name}"
    metrics.serve(relay_metrics.registry, settings.metrics_host, settings.metrics_port)
    # Fail fast on what a retry cannot fix (2PC off, schema missing, stream clash).
    try:
        relay.run()
    except OutboxError:
        relay.close()
        raise
    return 0


