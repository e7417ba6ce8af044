"""``outbox-resolver``: finish in-doubt prepared batches, in a loop or once (``--once``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from relay import __version__, config, logs, metrics
from relay.errors import ConfigError, StartupCheckError, TransientError
from relay.signals import Shutdown
from resolver.worker import Resolver, resolver_health

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
                        help="run one scan and exit (0: done; 1: could not decide)")
    config.add_options(parser, config.RESOLVER_OPTIONS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = config.ResolverSettings(**config.resolve(args, config.RESOLVER_OPTIONS))
    except ConfigError as exc:
        print(f"outbox-resolver: error: {exc}", file=sys.stderr)
        return 2
    logs.setup(settings.log_level, settings.log_format)
    shutdown = Shutdown()
    shutdown.install()
    resolver_metrics = metrics.ResolverMetrics()
    health = resolver_health(settings)
    resolver = Resolver(settings, metrics=resolver_metrics, health=health,
                        should_stop=lambda: shutdown.requested)
    try:
        if args.once:
            resolver.connect()
            outcomes = resolver.resolve_once()
            log.info("scan done", extra={"action": "scan_done", "resolved": len(outcomes)})
            return 0
        metrics.serve(resolver_metrics.registry, settings.metrics_host, settings.metrics_port,
                      health)
        resolver.run()
        return 0
    except ConfigError as exc:
        print(f"outbox-resolver: error: {exc}", file=sys.stderr)
        return 2
    except StartupCheckError as exc:
        # One line, in the configured log format (logging is set up by now).
        log.error("%s", exc, extra={"action": "startup_check_failed"})
        return 3
    except TransientError as exc:
        print(f"outbox-resolver: error: {exc}", file=sys.stderr)
        return 1
    finally:
        resolver.close()
