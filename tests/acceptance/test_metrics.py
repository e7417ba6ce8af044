"""Both programs serve every metric they declare (and document) over HTTP while they run."""

from __future__ import annotations

import re
import signal
import time
import urllib.request
from pathlib import Path

from devenv import checker
from devenv.servers import free_port
from outbox_relay.relay import metrics as relay_metrics
from outbox_relay.resolver import metrics as resolver_metrics
from outbox_relay.runtime import metrics
from tests.conftest import Env
from tests.integration.test_pipeline import outbox_count, wait_until


def scrape(port: int) -> str:
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                return resp.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def declared_metrics(program: str) -> set[str]:
    """The metrics ``program`` declares (docs/operations.md's table is generated from them)."""
    registry = (relay_metrics.RelayMetrics() if program == "relay"
                else resolver_metrics.ResolverMetrics()).registry
    return {described.name for described in metrics.describe(registry)}


def test_relay_and_resolver_serve_their_declared_metrics(env: Env) -> None:
    with env.connect() as conn:
        checker.insert_events(conn, env.table, 50, exchange=env.exchange,
                              routing_key=env.routing_key)
    relay_port, resolver_port = free_port(), free_port()
    relay = env.spawn("relay", OUTBOX_METRICS_PORT=str(relay_port), OUTBOX_STATS_INTERVAL="0.2",
                      OUTBOX_METRICS_HOST="127.0.0.1")
    resolver = env.spawn("resolver", OUTBOX_METRICS_PORT=str(resolver_port),
                         OUTBOX_METRICS_HOST="127.0.0.1", OUTBOX_RESOLVER_INTERVAL="0.2")
    wait_until(lambda: outbox_count(env) == 0, 30, "the outbox to empty")
    time.sleep(0.5)
    relay_text, resolver_text = scrape(relay_port), scrape(resolver_port)
    for program, text in (("relay", relay_text), ("resolver", resolver_text)):
        declared = declared_metrics(program)
        assert len(declared) >= 6
        for name in declared:
            assert re.search(rf"^{name}(_bucket|_count|_sum)?[{{ ]", text, re.M), (
                f"{name} missing from the {program}'s /metrics")
    assert re.search(r"^outbox_relay_events_published_total 50\.0$", relay_text, re.M)
    assert re.search(r'^outbox_relay_connected\{server="rabbitmq"\} 1\.0$', relay_text, re.M)
    assert re.search(r"^outbox_resolver_scans_total [1-9]", resolver_text, re.M)
    for proc in (relay, resolver):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, Path(proc.log_path).read_text()  # type: ignore[attr-defined]
