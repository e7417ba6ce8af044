"""Alert rules pass promtool's tests, and a real Prometheus scraping a running relay and resolver
gets data for every metric and every dashboard query."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from devenv import checker
from devenv.servers import free_port
from tests.conftest import ROOT, Env
from tests.integration.test_pipeline import log_of, outbox_count, wait_until

DEPLOY = ROOT / "deploy"


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not found: install Debian's prometheus package (./dev does)"
    return path


def test_alert_rules_pass_promtool() -> None:
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        result = subprocess.run([promtool(), *args], cwd=DEPLOY / "prometheus",
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def dashboard_queries() -> list[str]:
    board = json.loads((DEPLOY / "grafana" / "outbox-relay.json").read_text())
    return [t["expr"] for panel in board["panels"] for t in panel["targets"]]


def query(port: int, expr: str) -> list[object]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def test_prometheus_scrapes_every_metric_and_dashboard_query(env: Env, tmp_path: Path) -> None:
    prometheus = shutil.which("prometheus")
    assert prometheus, "prometheus not found: install Debian's prometheus package (./dev does)"
    relay_port, resolver_port, prom_port = free_port(), free_port(), free_port()
    with env.connect() as conn:
        checker.insert_events(conn, env.table, 200, exchange=env.exchange,
                              routing_key=env.routing_key)
    relay = env.spawn("relay", OUTBOX_METRICS_PORT=str(relay_port), OUTBOX_METRICS_HOST="127.0.0.1",
                      OUTBOX_STATS_INTERVAL="0.5", OUTBOX_BATCH_SIZE="20")
    resolver = env.spawn("resolver", OUTBOX_METRICS_PORT=str(resolver_port),
                         OUTBOX_METRICS_HOST="127.0.0.1", OUTBOX_RESOLVER_INTERVAL="0.5")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "rule_files:\n  - " + str(DEPLOY / "prometheus" / "alerts.yml") + "\n"
        "scrape_configs:\n"
        + "".join(f"  - job_name: {job}\n    static_configs:\n"
                  f"      - targets: ['127.0.0.1:{port}']\n"
                  for job, port in (("outbox-relay", relay_port),
                                    ("outbox-resolver", resolver_port))))
    server = subprocess.Popen(
        [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("wb"))
    try:
        wait_until(lambda: outbox_count(env) == 0, 60, "the relay to publish")
        names = [line.split("|")[1].strip().strip("`").split("{")[0]
                 for line in (ROOT / "README.md").read_text().splitlines()
                 if line.startswith("| `outbox_")]
        # A histogram's series are NAME_bucket, NAME_count and NAME_sum.
        queries = dashboard_queries() + [f'{{__name__=~"{n}|{n}_count"}}' for n in names]
        missing: list[str] = []
        deadline = time.monotonic() + 60
        while True:
            try:
                missing = [q for q in queries if not query(prom_port, q)]
            except OSError:
                missing = ["<prometheus not answering>"]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert not missing, f"no data for {missing}"
        assert len(queries) > 25
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
        for proc in (relay, resolver):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, log_of(proc)
