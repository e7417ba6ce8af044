"""The real CLIs as subprocesses: start-up checks, config errors, migrate, no password leaks."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devenv import launch
from devenv.servers import PostgresServer
from tests.conftest import ROOT, Env

SECRET = "s3cr3t-pw"


def run(program: str, *args: str, env: dict[str, str],
        timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(launch.command(program, *args), env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def pg_without_2pc() -> Iterator[PostgresServer]:
    with PostgresServer(max_prepared_transactions=0) as server:
        yield server


@pytest.mark.parametrize(
    ("variable", "value", "program"),
    [
        ("OUTBOX_BATCH_SIZE", "abc", "relay"),
        ("OUTBOX_BATCH_SIZE", "0", "relay"),
        ("OUTBOX_TABLE", 'outbox"; DROP TABLE users; --', "relay"),
        ("OUTBOX_GID_PREFIX", "x" * 40, "relay"),
        ("OUTBOX_GID_PREFIX", "it's", "resolver"),
        ("OUTBOX_AMQP_URL", "http://example", "resolver"),
        ("OUTBOX_RESOLVER_HARD_LIMIT", "-1", "resolver"),
    ],
)
def test_bad_config_exits_before_connecting_with_one_line(
    env: Env, variable: str, value: str, program: str
) -> None:
    # Unreachable servers: a program that tried to connect would retry, not exit at once.
    cli_env = env.cli_env(**{
        "OUTBOX_DATABASE_URL": f"postgresql://app:{SECRET}@127.0.0.1:9/nowhere",
        "OUTBOX_AMQP_URL": f"amqp://app:{SECRET}@127.0.0.1:9/",
    })
    cli_env[variable] = value
    started = time.monotonic()
    result = run(program, env=cli_env)
    assert result.returncode == 2, result.stderr
    assert time.monotonic() - started < 10
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and variable in lines[0], result.stderr
    assert SECRET not in result.stderr + result.stdout


def test_a_bad_url_is_named_but_not_shown(env: Env) -> None:
    cli_env = env.cli_env(OUTBOX_DATABASE_URL=f"mysql://app:{SECRET}@db/x")
    result = run("relay", env=cli_env)
    assert result.returncode == 2
    assert "OUTBOX_DATABASE_URL" in result.stderr and SECRET not in result.stderr


def test_hostile_table_name_changes_nothing(env: Env) -> None:
    hostile = 'x; DROP TABLE "pwned"'
    with env.connect() as conn:
        conn.execute('CREATE TABLE IF NOT EXISTS "pwned" (id int)')
    try:
        result = run("relay", "migrate", env=env.cli_env(OUTBOX_TABLE=hostile))
        assert result.returncode == 2 and "OUTBOX_TABLE" in result.stderr
        with env.connect() as conn:
            assert conn.execute("SELECT to_regclass('pwned') IS NOT NULL").fetchone() == (True,)
    finally:
        with env.connect() as conn:
            conn.execute('DROP TABLE IF EXISTS "pwned"')


def test_relay_refuses_postgres_without_2pc(env: Env, pg_without_2pc: PostgresServer) -> None:
    result = run("relay", env=env.cli_env(OUTBOX_DATABASE_URL=pg_without_2pc.url))
    assert result.returncode == 3, result.stderr
    assert "max_prepared_transactions = 0" in result.stderr


def test_resolver_refuses_postgres_without_2pc(env: Env, pg_without_2pc: PostgresServer) -> None:
    result = run("resolver", "--once", env=env.cli_env(OUTBOX_DATABASE_URL=pg_without_2pc.url))
    assert result.returncode == 3, result.stderr
    assert "max_prepared_transactions = 0" in result.stderr


def test_relay_refuses_a_missing_schema(env: Env) -> None:
    result = run("relay", env=env.cli_env(OUTBOX_TABLE="never_migrated"))
    assert result.returncode == 3, result.stderr
    assert "outbox-relay migrate" in result.stderr


def test_migrate_is_idempotent_and_printable(env: Env) -> None:
    for _ in range(2):
        result = run("relay", "migrate", env=env.cli_env())
        assert result.returncode == 0, result.stderr
    printed = run("relay", "migrate", "--print", env=env.cli_env(OUTBOX_TABLE="app.events"))
    assert printed.returncode == 0
    assert 'CREATE TABLE IF NOT EXISTS "app"."events"' in printed.stdout
    assert '"app"."events_dead_letter"' in printed.stdout


def test_unreachable_servers_are_retried_and_the_password_never_logged(env: Env) -> None:
    proc = env.spawn("relay", OUTBOX_DATABASE_URL=f"postgresql://app:{SECRET}@127.0.0.1:9/x",
                     OUTBOX_LOG_LEVEL="DEBUG")
    time.sleep(3)
    assert proc.poll() is None  # still retrying, not exited
    proc.terminate()
    assert proc.wait(10) == 0
    log = Path(proc.log_path).read_text()  # type: ignore[attr-defined]
    assert "reconnect to postgresql failed" in log
    assert SECRET not in log


@pytest.mark.parametrize("program", ["relay", "resolver"])
def test_secret_file_forms_reach_the_program_and_a_bad_one_is_one_line(
    env: Env, program: str, tmp_path: Path
) -> None:
    secret = tmp_path / "amqp-url"
    secret.write_text(f"amqp://app:{SECRET}@127.0.0.1:9/\n")
    cli_env = env.cli_env(OUTBOX_AMQP_URL="", OUTBOX_AMQP_URL_FILE=str(secret),
                          OUTBOX_DATABASE_URL="", OUTBOX_DATABASE_URL_FILE=str(tmp_path / "none"),
                          OUTBOX_METRICS_PORT="0")
    result = run(program, env=cli_env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"outbox-{program}: error: OUTBOX_DATABASE_URL_FILE names a file that cannot be read: "
        f"'{tmp_path / 'none'}' (No such file or directory)"]
    # With both files readable, the program starts and uses them (it keeps retrying port 9).
    (tmp_path / "none").write_text(f"postgresql://app:{SECRET}@127.0.0.1:9/x")
    log_path = tmp_path / "stderr.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(launch.command(program), env=cli_env, cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=log_file, text=True)
    try:
        # Wait for its first failed attempt (it tried the servers the files name), however
        # slowly a loaded machine starts it; then a SIGTERM must stop it cleanly.
        deadline = time.monotonic() + 60
        while "failed" not in log_path.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.1)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    err = log_path.read_text()
    assert proc.returncode == 0, err
    assert "failed" in err and SECRET not in out + err


def test_help_lists_every_env_var() -> None:
    from outbox_relay.relay.settings import RELAY_OPTIONS
    from outbox_relay.resolver.settings import RESOLVER_OPTIONS
    relay_help = run("relay", "run", "--help", env={"PYTHONPATH": str(ROOT)}).stdout
    resolver_help = run("resolver", "--help", env={"PYTHONPATH": str(ROOT)}).stdout
    for option in RELAY_OPTIONS:
        assert option.env in relay_help and option.flag in relay_help
    for option in RESOLVER_OPTIONS:
        assert option.env in resolver_help
