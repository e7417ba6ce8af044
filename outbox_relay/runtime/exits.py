"""Exit codes of both programs (docs/operations.md, exit codes) and the one place errors map to them."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from outbox_relay.errors import ConfigError, StartupCheckError, TransientError

EXIT_OK = 0  # done, or stopped by a signal
EXIT_FAILED = 1  # anything else (a server unreachable where nothing retries: --once, commands)
EXIT_CONFIG = 2  # bad configuration or arguments
EXIT_STARTUP = 3  # a server unfit for the protocol (2PC off, schema or ledger key missing...)


def run_program(program: str, log: logging.Logger, body: Callable[[], int]) -> int:
    """``body()``'s exit code, or the code of the error it raised, said in one line."""
    try:
        return body()
    except ConfigError as exc:
        print(f"{program}: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except StartupCheckError as exc:
        # One line, in the configured log format (logging is set up by now).
        log.error("%s", exc, extra={"action": "startup_check_failed"})
        return EXIT_STARTUP
    except TransientError as exc:
        print(f"{program}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
