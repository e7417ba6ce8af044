"""``outbox-relay``: run the relay (default), apply the schema (``migrate``), inspect and requeue
the dead-letter table (``dead-letter``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from outbox_relay.errors import ConfigError, OutboxError, StartupCheckError
from outbox_relay.postgres import connect
from outbox_relay.relay import dead_letter, faults
from outbox_relay.relay.metrics import RelayMetrics
from outbox_relay.relay.publisher import AmqpPublisher
from outbox_relay.relay.settings import RELAY_OPTIONS, RelaySettings
from outbox_relay.relay.store import OutboxStore
from outbox_relay.relay.worker import Relay, relay_health
from outbox_relay.runtime import http, logs, options
from outbox_relay.runtime.exits import EXIT_OK, EXIT_STARTUP, run_program
from outbox_relay.runtime.logs import printable
from outbox_relay.runtime.signals import Shutdown
from outbox_relay.schema import migrate, schema_sql
from outbox_relay.tables import Tables
from outbox_relay.version import __version__

log = logging.getLogger("relay")

MIGRATE_OPTIONS = (options.DATABASE_URL, options.TABLE, options.CONNECT_TIMEOUT,
                   options.LOG_LEVEL, options.LOG_FORMAT)
DEAD_LETTER_OPTIONS = (options.DATABASE_URL, options.TABLE, options.CONNECT_TIMEOUT)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox-relay",
        description="Relay outbox rows from PostgreSQL to RabbitMQ with two-phase commit. "
        "Every flag can also be set by the environment variable shown in its help.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{run,migrate,dead-letter}")
    run = sub.add_parser("run", help="relay events (the default)")
    options.add_options(run, RELAY_OPTIONS)
    mig = sub.add_parser("migrate", help="create the outbox tables if missing (idempotent)")
    mig.add_argument("--print", action="store_true", dest="print_only",
                     help="print the SQL instead of applying it (for psql -f)")
    options.add_options(mig, MIGRATE_OPTIONS)
    dead = sub.add_parser(
        "dead-letter", help="list the dead-letter table or move rows back into the outbox",
        description="Inspect <table>_dead_letter, or requeue rows from it: they go back into the "
        "outbox in one transaction with attempts 0, due now; a row with an ordering key gets its "
        "old id back (the rows of its key that waited behind it stay behind it), others a new id.")
    dead_sub = dead.add_subparsers(dest="dead_letter_command", metavar="{list,requeue}",
                                   required=True)
    listing = dead_sub.add_parser(
        "list", help="print the dead letters, oldest first (tab-separated: id, message_id, "
        "exchange, routing_key, attempts, dead_at, last_error; control characters escaped)")
    listing.add_argument("--limit", type=_positive_int, default=100, metavar="N",
                         help="print at most N rows (default: 100)")
    listing.add_argument("--json", action="store_true", help="print a JSON array instead")
    options.add_options(listing, DEAD_LETTER_OPTIONS)
    requeue = dead_sub.add_parser(
        "requeue", help="move dead letters back into the outbox (one transaction)")
    which = requeue.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", type=_positive_int, action="append", dest="ids", metavar="ID",
                       help="dead-letter id to requeue (repeat for several)")
    which.add_argument("--all", action="store_true", help="requeue every dead letter")
    options.add_options(requeue, DEAD_LETTER_OPTIONS)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text!r})")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (args_list[0].startswith("-")
                         and args_list[0] not in ("-h", "--help", "--version")):
        args_list.insert(0, "run")
    args = build_parser().parse_args(args_list)
    command = {"migrate": _migrate, "dead-letter": _dead_letter}.get(args.command, _run)
    return run_program("outbox-relay", log, lambda: command(args))


def _migrate(args: argparse.Namespace) -> int:
    if args.print_only:
        table = options.resolve(args, (options.TABLE,))["table"]
        sys.stdout.write(schema_sql(table) + "\n")
        return EXIT_OK
    values = options.resolve(args, MIGRATE_OPTIONS)
    logs.setup(values["log_level"], values["log_format"])
    migrate(values["database_url"], values["table"], timeout=values["connect_timeout"])
    log.info("schema applied", extra={"action": "schema_applied", "table": values["table"]})
    return EXIT_OK


def _run(args: argparse.Namespace) -> int:
    settings = RelaySettings(**options.resolve(args, RELAY_OPTIONS))
    try:
        fault = faults.crash_hook()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    logs.setup(settings.log_level, settings.log_format)
    shutdown = Shutdown()
    shutdown.install()
    relay_metrics = RelayMetrics(confirm_timeout=settings.confirm_timeout)
    health = relay_health(settings)
    store = OutboxStore(settings.database_url, settings.table,
                        connect_timeout=settings.connect_timeout,
                        standby_wait=settings.standby_wait,
                        standby_wait_timeout=settings.standby_wait_timeout)
    publisher = AmqpPublisher(
        settings.amqp_url, ledger_stream=settings.ledger_stream,
        ledger_max_age=settings.ledger_max_age, confirm_timeout=settings.confirm_timeout,
        connect_timeout=settings.connect_timeout, user_id=settings.amqp_user_id, fault=fault)
    relay = Relay(settings, store, publisher, metrics=relay_metrics, health=health, fault=fault,
                  shutdown=shutdown)
    publisher.name = f"outbox-relay {relay.instance_name}"
    http.serve(relay_metrics.registry, settings.metrics_host, settings.metrics_port, health)
    # Fail fast on what a retry cannot fix (2PC off, schema missing, stream clash).
    try:
        relay.run()
    except OutboxError:
        relay.close()
        raise
    return EXIT_OK


def _dead_letter(args: argparse.Namespace) -> int:
    values = options.resolve(args, DEAD_LETTER_OPTIONS)
    try:
        return _dead_letter_command(args, values["database_url"], Tables(values["table"]),
                                    values["connect_timeout"])
    except StartupCheckError as exc:  # a missing table: one line, no log set up to repeat it
        print(f"outbox-relay: error: {exc}", file=sys.stderr)
        return EXIT_STARTUP


def _dead_letter_command(args: argparse.Namespace, database_url: str, tables: Tables,
                         connect_timeout: float) -> int:
    with connect(database_url, timeout=connect_timeout,
                 application_name="outbox-relay dead-letter") as conn:
        if args.dead_letter_command == "list":
            rows, total = dead_letter.list_dead_letters(conn, tables, args.limit)
            if args.json:
                json.dump([{"id": r.id, "message_id": r.message_id, "exchange": r.exchange,
                            "routing_key": r.routing_key, "attempts": r.attempts,
                            "dead_at": r.dead_at.isoformat(), "last_error": r.last_error}
                           for r in rows], sys.stdout, indent=2)
                sys.stdout.write("\n")
            else:
                for r in rows:
                    # One line each, whatever the producer's text holds: its control characters
                    # (a tab, a newline, a terminal's escape sequence) escaped, and the error's
                    # lines joined.
                    error = printable(" ".join(r.last_error.split()))
                    print("\t".join((str(r.id), printable(r.message_id), printable(r.exchange),
                                     printable(r.routing_key), str(r.attempts),
                                     r.dead_at.isoformat(), error)))
            if total > len(rows):
                print(f"outbox-relay: {len(rows)} of {total} dead letters shown (--limit)",
                      file=sys.stderr)
            return EXIT_OK
        result = dead_letter.requeue(conn, tables, None if args.all else args.ids)
    for dead_id, message_id in result.skipped.items():
        print(f"skipped dead letter {dead_id}: message_id {message_id!r} is already in the outbox")
    for dead_id in result.missing:
        print(f"skipped dead letter {dead_id}: not in {tables.dead_letter_name}")
    print(f"requeued {len(result.moved)} dead letter{'' if len(result.moved) == 1 else 's'} "
          f"into {tables.name}")
    return EXIT_OK
