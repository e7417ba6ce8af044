"""``outbox-inbox``: create a consumer's inbox tables (``migrate``) and prune old entries
(``prune``), in the consumer's own database. The inbox itself runs in the consumer's code
(``outbox_relay.Inbox``)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any

import psycopg

from outbox_relay.errors import ConfigError, TransientError, first_line
from outbox_relay.inbox import Inbox, inbox_schema_sql
from outbox_relay.postgres import connect
from outbox_relay.runtime import options
from outbox_relay.tables import table_name
from outbox_relay.version import __version__

_AGE_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(D|h|m|s)?$")
_UNIT_SECONDS = {"D": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, None: 1.0}


def age_seconds(text: str) -> float:
    """``7D``, ``36h``, ``90m``, ``3600s`` or ``3600`` as seconds (positive)."""
    match = _AGE_RE.fullmatch(text.strip())
    seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)] if match else 0.0
    if not seconds > 0:
        raise ValueError("must be a positive age such as 7D, 36h, 90m or 3600s")
    return seconds


DATABASE_URL = options.Option(
    "database_url", "OUTBOX_INBOX_DATABASE_URL", options.DATABASE_URL.parse, None,
    "PostgreSQL URL of the consumer's database (where its inbox and its effects live)",
    secret=True)
TABLE = options.Option("table", "OUTBOX_INBOX_TABLE", table_name, "inbox",
                      "inbox table ([schema.]name)")
RETENTION = options.Option(
    "older_than", "OUTBOX_INBOX_RETENTION", age_seconds, "7D",
    "delete entries processed longer ago than this (D, h, m or s); keep it above the longest "
    "time between two copies of a message")


# Every setting of the command (for docs/configuration.md); `migrate` reads all but RETENTION.
INBOX_OPTIONS: tuple[options.Option[Any], ...] = (DATABASE_URL, TABLE, RETENTION,
                                                 options.CONNECT_TIMEOUT)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox-inbox",
        description="The consumers' inbox of outbox-relay: create its tables, prune old "
        "entries. Every flag can also be set by the environment variable shown in its help.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{migrate,prune}", required=True)
    mig = sub.add_parser("migrate", help="create the inbox tables if missing (idempotent)")
    mig.add_argument("--print", action="store_true", dest="print_only",
                     help="print the SQL instead of applying it (for psql -f)")
    options.add_options(mig, (DATABASE_URL, TABLE, options.CONNECT_TIMEOUT))
    prune = sub.add_parser("prune", help="delete inbox entries older than the retention")
    options.add_options(prune, (DATABASE_URL, TABLE, RETENTION, options.CONNECT_TIMEOUT))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "migrate" and args.print_only:
            table = options.resolve(args, (TABLE,))["table"]
            sys.stdout.write(inbox_schema_sql(table) + "\n")
            return 0
        wanted = (DATABASE_URL, TABLE, options.CONNECT_TIMEOUT) + (
            (RETENTION,) if args.command == "prune" else ())
        values = options.resolve(args, wanted)
        inbox = Inbox(values["table"])
        with connect(values["database_url"], timeout=values["connect_timeout"],
                     application_name=f"outbox-inbox {args.command}") as conn:
            if args.command == "migrate":
                inbox.migrate(conn)
                print(f"inbox {values['table']} ready")
            else:
                deleted = inbox.prune(conn, older_than=values["older_than"])
                print(f"pruned {deleted} inbox entr{'y' if deleted == 1 else 'ies'} older than "
                      f"{values['older_than']:g} s from {values['table']}")
        return 0
    except ConfigError as exc:
        print(f"outbox-inbox: error: {exc}", file=sys.stderr)
        return 2
    except (TransientError, psycopg.Error) as exc:
        print(f"outbox-inbox: error: {first_line(str(exc))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
