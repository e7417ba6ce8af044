"""TLS on both connections, in exactly the URL forms docs/operations.md documents, against a
PostgreSQL and a RabbitMQ of this module's own that serve certificates from a throwaway CA. And
the failures an operator meets first: an untrusted certificate is retried, and said once, in the
log."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from devenv import checker
from devenv.servers import PostgresServer, RabbitServer, free_port
from tests.conftest import Env, finish_env, make_env
from tests.integration.test_pipeline import log_of, outbox_count, stop, wait_until


def openssl(*args: str, cwd: Path) -> None:
    binary = shutil.which("openssl")
    assert binary, "openssl not found: install Debian's openssl package"
    result = subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def certs() -> Iterator[Path]:
    """ca.pem, and server.pem/server.key for localhost and 127.0.0.1 signed by it."""
    directory = Path(tempfile.mkdtemp(prefix="outbox-tls-"))
    directory.chmod(0o755)  # PostgreSQL runs as the postgres OS user when we are root
    try:
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
                "ca.pem", "-days", "2", "-subj", "/CN=outbox-relay test CA", cwd=directory)
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
                "server.csr", "-subj", "/CN=localhost", cwd=directory)
        (directory / "san.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "san.cnf",
                cwd=directory)
        for name in ("ca.pem", "server.pem"):
            (directory / name).chmod(0o644)
        # PostgreSQL wants its key private to the user it runs as.
        shutil.copy(directory / "server.key", directory / "pg.key")
        (directory / "pg.key").chmod(0o600)
        if os.geteuid() == 0:
            postgres = pwd.getpwnam("postgres")
            os.chown(directory / "pg.key", postgres.pw_uid, postgres.pw_gid)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def tls_pg(certs: Path) -> Iterator[PostgresServer]:
    with PostgresServer(max_prepared_transactions=8, extra_conf={
        "ssl": "on", "ssl_cert_file": str(certs / "server.pem"),
        "ssl_key_file": str(certs / "pg.key"),
    }) as server:
        yield server


@pytest.fixture(scope="module")
def tls_rabbit(certs: Path) -> Iterator[tuple[RabbitServer, int]]:
    """The node and its TLS port (its plain port stays open for the test's own setup)."""
    port = free_port()
    with RabbitServer(extra_conf=[
        f"listeners.ssl.default = 127.0.0.1:{port}",
        f"ssl_options.cacertfile = {certs / 'ca.pem'}",
        f"ssl_options.certfile = {certs / 'server.pem'}",
        f"ssl_options.keyfile = {certs / 'server.key'}",
        "ssl_options.verify = verify_none",
        "ssl_options.fail_if_no_peer_cert = false",
    ]) as server:
        yield server, port


@pytest.fixture
def tenv(tls_pg: PostgresServer, tls_rabbit: tuple[RabbitServer, int]) -> Iterator[Env]:
    e = make_env(tls_pg.url, tls_rabbit[0].url, tag="s")  # set up over plain connections
    yield e
    finish_env(e, drop=False)  # the servers go away with the module


def test_relay_and_resolver_connect_over_verified_tls(
        tenv: Env, tls_pg: PostgresServer, tls_rabbit: tuple[RabbitServer, int],
        certs: Path) -> None:
    env = tenv
    rabbit, tls_port = tls_rabbit
    ca = certs / "ca.pem"
    # The documented forms: libpq's own parameters, pika's ssl_options (URL-encoded), and
    # sslrootcert=system / a plain amqps:// URL verified against the CA file named by
    # SSL_CERT_FILE (the "system" store).
    pg_url = (f"postgresql://postgres@localhost:{tls_pg.port}/outbox"
              f"?sslmode=verify-full&sslrootcert={ca}")
    amqp_url = (f"amqps://guest:guest@localhost:{tls_port}/%2F?"
                + urllib.parse.urlencode({"ssl_options": repr({"ca_certs": str(ca)})}))
    with env.connect() as conn:
        produced = checker.insert_events(conn, env.table, 300, exchange=env.exchange,
                                         routing_key=env.routing_key)
    relay = env.spawn("relay", OUTBOX_DATABASE_URL=pg_url, OUTBOX_AMQP_URL=amqp_url,
                      OUTBOX_BATCH_SIZE="50")
    # libpq 16+ (psycopg's binary wheels bundle a newer one) trusts the system store with
    # sslrootcert=system, which SSL_CERT_FILE replaces here.
    system_pg_url = f"postgresql://postgres@localhost:{tls_pg.port}/outbox?sslrootcert=system"
    resolver = env.spawn("resolver", OUTBOX_DATABASE_URL=system_pg_url, SSL_CERT_FILE=str(ca),
                         OUTBOX_AMQP_URL=f"amqps://guest:guest@localhost:{tls_port}/%2F",
                         OUTBOX_RESOLVER_INTERVAL="0.2")
    wait_until(lambda: outbox_count(env) == 0, 60, "the relay to publish over TLS")
    wait_until(lambda: "resolver" in rabbit.ctl("list_connections", "name", "client_properties")
               or resolver.poll() is not None, 30, "the resolver to connect")

    with env.connect() as conn:
        sessions = conn.execute(
            "SELECT a.application_name, s.ssl, s.version FROM pg_stat_ssl s "
            "JOIN pg_stat_activity a USING (pid) "
            "WHERE a.application_name IN ('outbox-relay', 'outbox-resolver')").fetchall()
    assert {name for name, _ssl, _version in sessions} == {"outbox-relay", "outbox-resolver"}
    assert all(ssl and version.startswith("TLS") for _name, ssl, version in sessions), sessions
    # Every AMQP connection now open is one of theirs (the test's own are closed): all on TLS.
    connections = rabbit.ctl("list_connections", "ssl", "port", "--no-table-headers", "-q")
    rows = [line.split() for line in connections.splitlines() if line.strip()]
    assert len(rows) >= 2, connections
    assert all(row == ["true", str(tls_port)] for row in rows), connections

    assert stop(relay) == 0, log_of(relay)
    assert stop(resolver) == 0, log_of(resolver)
    report = env.drain_and_check(produced)
    assert report.ok(max_duplicates=0), report.summary()


def test_an_untrusted_certificate_is_retried_and_said_once(
        tenv: Env, tls_pg: PostgresServer, tls_rabbit: tuple[RabbitServer, int]) -> None:
    env = tenv
    empty = Path(tempfile.mkdtemp(prefix="outbox-no-ca-"))
    try:
        # No CA for either server: libpq's default root.crt is missing, the system store
        # (SSL_CERT_FILE pointing at an empty file) does not know our CA.
        (empty / "empty.pem").write_text("")
        relay = env.spawn(
            "relay", HOME=str(empty), SSL_CERT_FILE=str(empty / "empty.pem"),
            OUTBOX_DATABASE_URL=f"postgresql://postgres@localhost:{tls_pg.port}/outbox"
                                "?sslmode=verify-full",
            OUTBOX_AMQP_URL=f"amqps://guest:guest@localhost:{tls_rabbit[1]}/%2F",
            OUTBOX_RECONNECT_MAX_DELAY="0.5")
        time.sleep(4)
        assert relay.poll() is None, log_of(relay)  # retrying, not exited
        assert stop(relay) == 0, log_of(relay)
    finally:
        shutil.rmtree(empty, ignore_errors=True)
    log = log_of(relay)
    warnings = [line for line in log.splitlines() if "connecting to postgresql failed" in line]
    assert len(warnings) == 1, log  # once per outage, not once per attempt
    assert re.search(r"root certificate file .* does not exist", warnings[0]), warnings


def test_an_untrusted_broker_certificate_is_named_in_the_log(
        tenv: Env, tls_rabbit: tuple[RabbitServer, int]) -> None:
    env = tenv
    empty = Path(tempfile.mkdtemp(prefix="outbox-no-ca-"))
    try:
        (empty / "empty.pem").write_text("")
        relay = env.spawn("relay", SSL_CERT_FILE=str(empty / "empty.pem"),
                          OUTBOX_AMQP_URL=f"amqps://guest:guest@localhost:{tls_rabbit[1]}/%2F",
                          OUTBOX_RECONNECT_MAX_DELAY="0.5")
        wait_until(lambda: "connecting to rabbitmq failed" in log_of(relay)
                   or relay.poll() is not None, 30, "the failed TLS handshake")
        assert stop(relay) == 0, log_of(relay)
    finally:
        shutil.rmtree(empty, ignore_errors=True)
    assert "CERTIFICATE_VERIFY_FAILED" in log_of(relay), log_of(relay)
