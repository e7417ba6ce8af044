"""The start-up check visits every other host of a multi-host OUTBOX_DATABASE_URL: a standby
whose max_prepared_transactions is below the primary's stops both programs (exit 3, one line),
an unreachable host is a warning (issue 14)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator

import psycopg
import pytest

from devenv.servers import PostgresPair, RabbitServer
from outbox_relay.errors import StartupCheckError
from outbox_relay.postgres import check_standbys
from tests.conftest import ROOT, External, finish_env, make_env, server_url


@pytest.fixture
def lowered() -> Iterator[PostgresPair]:
    """An asynchronous pair whose primary was raised to 32 prepared transactions after the
    standby was made with 16: the standby pauses its replay, as PostgreSQL does then."""
    with PostgresPair(sync=False, max_prepared_transactions=16) as pair:
        with psycopg.connect(pair.primary.admin_url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET max_prepared_transactions = 32")
        pair.primary.restart()
        yield pair


def test_a_standby_below_the_primary_is_refused_by_both_programs(
    lowered: PostgresPair, rabbit_server: RabbitServer | External,
) -> None:
    line = (f"standby 127.0.0.1:{lowered.standby.port} has max_prepared_transactions = 16, "
            "below the primary's 32: it pauses replay, and promoted it could not hold the "
            "relays' prepared batches; set it to 32 or more and restart it")
    with psycopg.connect(lowered.url, autocommit=True) as conn, \
            pytest.raises(StartupCheckError, match=re.escape(line)):
        check_standbys(lowered.url, conn, 3.0)
    env = make_env(lowered.url, server_url(rabbit_server), tag="s")
    try:
        for args in (["outbox_relay.relay"], ["outbox_relay.resolver", "--once"]):
            done = subprocess.run([sys.executable, "-m", *args], env=env.cli_env(), cwd=ROOT,
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 3, done.stderr
            assert line in done.stderr, done.stderr
    finally:
        finish_env(env)


def test_an_unreachable_standby_is_a_warning() -> None:
    with PostgresPair(sync=False, max_prepared_transactions=16) as pair:
        pair.standby.stop()
        with psycopg.connect(pair.url, autocommit=True) as conn:
            warnings = check_standbys(pair.url, conn, 2.0)
        assert len(warnings) == 1 and warnings[0].startswith(
            f"standby 127.0.0.1:{pair.standby.port} not checked: "), warnings
