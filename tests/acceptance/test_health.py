"""/healthz and /readyz of both programs, on the metrics port, next to an unchanged /metrics."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from devenv import launch
from devenv.servers import free_port
from outbox_relay.runtime.health import Health, stall_threshold
from tests.conftest import ROOT, Env

UNREACHABLE_PG = "postgresql://app:pw@127.0.0.1:9/nowhere"


def get(port: int, path: str) -> tuple[int, str, str]:
    """(status, content type, body) of a GET; waits for the server to come up."""
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
                return resp.status, resp.headers["Content-Type"], resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers["Content-Type"], exc.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def wait_for_status(port: int, path: str, status: int, timeout: float = 30) -> tuple[int, str, str]:
    deadline = time.monotonic() + timeout
    while True:
        got = get(port, path)
        if got[0] == status or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0, Path(proc.log_path).read_text()  # type: ignore[attr-defined]


def spawn(env: Env, program: str, **extra: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = env.spawn(program, OUTBOX_METRICS_PORT=str(port), OUTBOX_METRICS_HOST="127.0.0.1",
                     **extra)
    return proc, port


def test_connected_relay_and_resolver_are_live_and_ready(env: Env) -> None:
    relay, relay_port = spawn(env, "relay")
    resolver, resolver_port = spawn(env, "resolver", OUTBOX_RESOLVER_INTERVAL="0.2")
    for port, last_loop in ((relay_port, "outbox_relay_last_loop_timestamp_seconds"),
                            (resolver_port, "outbox_resolver_last_loop_timestamp_seconds")):
        status, content_type, body = wait_for_status(port, "/readyz", 200)
        assert status == 200, body
        assert content_type == "application/json"
        assert json.loads(body) == {"ready": True,
                                    "checks": {"postgresql": "ok", "rabbitmq": "ok"}}
        status, _, body = get(port, "/healthz")
        assert (status, body.strip()) == (200, "ok")
        # /metrics is what it was: the text exposition format, every metric there.
        status, content_type, body = get(port, "/metrics")
        assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
        assert f"\n{last_loop} " in body
        assert get(port, "/nothing-here")[0] == 404
    relay_metrics = get(relay_port, "/metrics")[2]
    assert 'outbox_relay_connected{server="postgresql"} 1.0' in relay_metrics
    assert "outbox_resolver_scans_total" in get(resolver_port, "/metrics")[2]
    for proc in (relay, resolver):
        stop(proc)


def test_unreachable_postgresql_is_live_but_not_ready(env: Env) -> None:
    """Retrying an unreachable server is the loop doing its job: a restart would not help, so
    /healthz stays 200; /readyz says 503 and which server is the problem."""
    relay, relay_port = spawn(env, "relay", OUTBOX_DATABASE_URL=UNREACHABLE_PG,
                              OUTBOX_RECONNECT_MAX_DELAY="0.5")
    resolver, resolver_port = spawn(env, "resolver", OUTBOX_DATABASE_URL=UNREACHABLE_PG,
                                    OUTBOX_RECONNECT_MAX_DELAY="0.5")
    time.sleep(2)
    for port in (relay_port, resolver_port):
        status, _, body = get(port, "/readyz")
        assert status == 503, body
        report = json.loads(body)
        assert report["ready"] is False
        # Which server and why, not where: no host, port or user (the logs have them).
        assert report["checks"]["postgresql"].endswith(": connection refused"), report
        for detail in ("pw", "app", "127.0.0.1", ":9", "port 9", "nowhere"):
            assert detail not in body, body
        assert get(port, "/healthz")[0] == 200
        assert get(port, "/metrics")[0] == 200
    # The relay connects to PostgreSQL first and never got to RabbitMQ; the resolver did.
    assert json.loads(get(relay_port, "/readyz")[2])["checks"]["rabbitmq"] == "not connected yet"
    assert json.loads(get(resolver_port, "/readyz")[2])["checks"]["rabbitmq"] == "ok"
    for proc in (relay, resolver):
        stop(proc)


def test_a_port_in_use_is_a_one_line_config_error(env: Env) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for program in ("relay", "resolver"):
            result = subprocess.run(
                launch.command(program),
                env=env.cli_env(OUTBOX_METRICS_PORT=str(port), OUTBOX_METRICS_HOST="127.0.0.1"),
                cwd=ROOT, capture_output=True, text=True, timeout=30)
            assert result.returncode == 2, result.stderr
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and "OUTBOX_METRICS_PORT" in lines[0], result.stderr


def test_liveness_fails_when_the_loop_stops_turning() -> None:
    now = [100.0]

    def clock() -> float:
        return now[0]

    health = Health(("postgresql",), stall_after=stall_threshold(5), clock=clock)
    assert health.stall_after == 30  # never under 30 s
    assert health.liveness()[0]
    now[0] += 31
    live, detail = health.liveness()
    assert not live and "31 s" in detail
    health.beat()
    assert health.liveness() == (True, "ok")
    assert stall_threshold(60, 10, 30) == 180


def test_readiness_names_the_failing_check() -> None:
    health = Health(("postgresql", "rabbitmq"), stall_after=30)
    checks: dict[str, Any]
    ready, checks = health.readiness()
    assert not ready and checks["postgresql"] == "not connected yet"
    health.set_check("postgresql", None)
    health.set_check("rabbitmq", "cannot connect", "AMQPConnectionError: timed out\nmore detail")
    ready, checks = health.readiness()
    assert not ready
    assert checks == {"postgresql": "ok", "rabbitmq": "cannot connect: timed out"}
    health.set_check("rabbitmq", None)
    assert health.readiness() == (True, {"postgresql": "ok", "rabbitmq": "ok"})
    health.stopping()
    assert health.readiness() == (False, {"postgresql": "ok", "rabbitmq": "ok", "shutdown": "stopping"})
