"""A PostgreSQL whose backends run under callgrind, and their instruction counts.

Shared by benchmarks.studies.instructions (one claim session) and benchmarks.studies.claims
--callgrind (relays claiming in turn). Needs valgrind (Debian's package).
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any

from devenv.servers import PostgresServer

_TOTALS = re.compile(r"^(?:totals|summary): (\d+)", re.M)


def callgrind_server(**settings: Any) -> PostgresServer:
    """A PostgreSQL whose every backend will run under callgrind (read with backend_total);
    start it with a timeout of minutes, clean it up with stop_server."""
    return PostgresServer(wrapper=[
        "valgrind", "--tool=callgrind", "--trace-children=no",
        "--callgrind-out-file={dir}/callgrind.%p"], **settings)


def stop_server(server: PostgresServer) -> None:
    """Clean up a server, and a callgrind_server's files written late (a server without a
    wrapper writes none: no sweep)."""
    directory = server.directory
    server.cleanup()
    if server.wrapper:
        _remove_late_files(directory)


def backend_total(server: PostgresServer, pid: int, timeout: float = 300.0) -> int:
    """The instructions of backend ``pid``, from the file callgrind writes when it exits."""
    assert server.directory is not None
    path = server.directory / f"callgrind.{pid}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            found = _TOTALS.search(path.read_text(errors="replace"))
            if found:
                return int(found.group(1))
        time.sleep(0.5)
    raise RuntimeError(f"no callgrind output for backend {pid} in {path}")


def _remove_late_files(directory: Path | None, quiet: float = 2.0, limit: float = 30.0) -> None:
    """Server processes under callgrind write their files as they exit, after cleanup() has
    emptied the directory: remove it again until it has stayed gone for ``quiet`` seconds."""
    if directory is None:
        return
    deadline, gone_since = time.monotonic() + limit, time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - gone_since < quiet:
        if directory.exists():
            shutil.rmtree(directory, ignore_errors=True)
            gone_since = time.monotonic()
        time.sleep(0.2)
