"""The metrics port: prometheus_client's own exposition at /metrics, the two probes, 404 elsewhere,
and a client that sends nothing is dropped after the connection timeout without blocking others."""

from __future__ import annotations

import gzip
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from outbox_relay.errors import ConfigError
from outbox_relay.relay.metrics import (
    BATCH_FAILURE_REASONS,
    ROW_FAILURE_REASONS,
    RelayMetrics,
    batch_duration_buckets,
)
from outbox_relay.resolver.metrics import ResolverMetrics
from outbox_relay.runtime import http
from outbox_relay.runtime.health import Health


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, RelayMetrics, Health]]:
    monkeypatch.setattr(http._Handler, "timeout", 0.5)
    relay_metrics = RelayMetrics(confirm_timeout=30)
    health = Health(("postgresql", "rabbitmq"), stall_after=30)
    server = http.serve(relay_metrics.registry, "127.0.0.1", _free_port(), health)
    assert server is not None
    try:
        yield server.server_address[1], relay_metrics, health
    finally:
        server.shutdown()
        server.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_metrics_is_prometheus_clients_exposition(served: tuple[int, RelayMetrics, Health]) -> None:
    port, relay_metrics, _health = served
    relay_metrics.events_published.inc(3)
    status, headers, body = get(port, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = body.decode()
    assert "outbox_relay_events_published_total 3.0" in text
    assert 'outbox_relay_build_info{version="' in text
    for standard in ("process_resident_memory_bytes", "process_cpu_seconds_total", "python_info",
                     "python_gc_collections_total"):
        assert f"\n{standard}" in text, standard
    # What the home-made server had to re-implement, now prometheus_client's own:
    status, headers, body = get(port, "/metrics", {"Accept": "application/openmetrics-text"})
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.decode().endswith("# EOF\n")
    status, headers, body = get(port, "/metrics", {"Accept-Encoding": "gzip"})
    assert headers["Content-Encoding"] == "gzip"
    assert b"outbox_relay_lag_seconds" in gzip.decompress(body)
    status, _, body = get(port, "/metrics?name[]=outbox_relay_lag_seconds")
    assert body.decode().count("# TYPE") == 1


def test_probes_and_not_found(served: tuple[int, RelayMetrics, Health]) -> None:
    port, _metrics, health = served
    assert get(port, "/healthz")[::2] == (200, b"ok\n")
    status, headers, body = get(port, "/readyz")
    assert status == 503 and headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"ready": False, "checks": {"postgresql": "not connected yet",
                                                           "rabbitmq": "not connected yet"}}
    health.set_check("postgresql", None)
    health.set_check("rabbitmq", None)
    assert get(port, "/readyz")[0] == 200
    assert get(port, "/")[0] == 404
    assert get(port, "/metricsx")[0] == 404


def test_a_silent_client_is_dropped_and_does_not_block_others(
    served: tuple[int, RelayMetrics, Health]
) -> None:
    port, _metrics, _health = served
    with socket.create_connection(("127.0.0.1", port)) as silent:
        # Another client is served while the first sends nothing.
        assert get(port, "/healthz")[0] == 200
        silent.settimeout(5)
        started = time.monotonic()
        assert silent.recv(1024) == b""  # closed by the server, not answered
        assert time.monotonic() - started < 3


def test_port_zero_serves_nothing() -> None:
    assert http.serve(ResolverMetrics().registry, "127.0.0.1", 0) is None


def test_a_port_in_use_is_a_config_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ConfigError, match=r"^OUTBOX_METRICS_PORT "):
            http.serve(ResolverMetrics().registry, "127.0.0.1", busy.getsockname()[1])


@pytest.mark.parametrize(("timeout", "top"), [(30, 60), (5, 10), (0.5, 1.0)])
def test_batch_duration_buckets_reach_twice_the_confirm_timeout(timeout: float, top: float) -> None:
    buckets = batch_duration_buckets(timeout)
    assert buckets[-1] == top and timeout in buckets
    assert list(buckets) == sorted(set(buckets))
    registry = RelayMetrics(confirm_timeout=timeout).registry
    assert registry.get_sample_value("outbox_relay_batch_duration_seconds_bucket",
                                     {"le": str(float(top))}) == 0


def test_failure_counters_pre_declare_their_reasons() -> None:
    registry = RelayMetrics().registry
    for reason in ROW_FAILURE_REASONS:
        assert registry.get_sample_value("outbox_relay_row_failures_total", {"reason": reason}) == 0
    for reason in BATCH_FAILURE_REASONS:
        assert registry.get_sample_value("outbox_relay_batch_failures_total", {"reason": reason}) == 0
