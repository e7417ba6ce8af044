"""``outbox-resolver``: finish in-doubt prepared batches, in a loop or once (``--once``)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from outbox_relay.resolver.metrics import ResolverMetrics
from outbox_relay.resolver.settings import RESOLVER_OPTIONS, ResolverSettings
from outbox_relay.resolver.worker import Resolver, resolver_health
from outbox_relay.runtime import http, logs, options
from outbox_relay.runtime.exits import EXIT_FAILED, EXIT_OK, run_program
from outbox_relay.runtime.signals import Shutdown
from outbox_relay.version import __version__

log = logging.getLogger("resolver")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox-resolver",
        description="Commit or roll back the outbox relay's in-doubt prepared transactions "
        "from what the ledger stream says. Every flag can also be set by the environment "
        "variable shown in its help.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--once", action="store_true",
                        help=f"run one scan and exit ({EXIT_OK}: done; {EXIT_FAILED}: could not "
                        "decide)")
    options.add_options(parser, RESOLVER_OPTIONS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_program("outbox-resolver", log, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    settings = ResolverSettings(**options.resolve(args, RESOLVER_OPTIONS))
    logs.setup(settings.log_level, settings.log_format)
    shutdown = Shutdown()
    shutdown.install()
    resolver_metrics = ResolverMetrics()
    health = resolver_health(settings)
    resolver = Resolver(settings, metrics=resolver_metrics, health=health, shutdown=shutdown)
    try:
        if args.once:
            resolver.connect()
            outcomes = resolver.resolve_once()
            log.info("scan done", extra={"action": "scan_done", "resolved": len(outcomes)})
            return EXIT_OK
        http.serve(resolver_metrics.registry, settings.metrics_host, settings.metrics_port,
                      health)
        resolver.run()
        return EXIT_OK
    finally:
        resolver.close()
