"""Alert rules pass promtool's tests (also under other job labels), and a real Prometheus
scraping a running relay and resolver gets data for every metric and every dashboard query,
while no alert condition holds."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import psycopg
import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server
from psycopg import sql

from devenv import checker
from devenv.servers import free_port
from outbox_relay import Inbox
from outbox_relay.inbox_metrics import InboxMetrics
from outbox_relay.relay import metrics as relay_metrics
from outbox_relay.resolver import metrics as resolver_metrics
from outbox_relay.runtime import metrics
from tests.conftest import ROOT, Env
from tests.integration.test_pipeline import log_of, outbox_count, wait_until

DEPLOY = ROOT / "deploy"


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not found: install Debian's prometheus package (./dev does)"
    return path


def run_promtool(*args: str, cwd: Path) -> None:
    result = subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_pass_promtool() -> None:
    run_promtool("check", "rules", "alerts.yml", cwd=DEPLOY / "prometheus")
    run_promtool("test", "rules", "alerts_test.yml", cwd=DEPLOY / "prometheus")


# The tests' jobs are compose's; a rule that named one would fail under these.
_JOB = re.compile(r"(?<![\w-])outbox-(relay|resolver)(?![\w/-]| dead-letter list)")


@pytest.mark.parametrize("jobs", [
    {"relay": "orders", "resolver": "orders-outbox-resolver"},      # PodMonitor, jobLabel: app
    {"relay": "kubernetes-pods", "resolver": "kubernetes-pods"},    # annotation discovery
], ids=["podmonitor", "annotations"])
def test_alert_rule_tests_pass_under_other_job_labels(jobs: dict[str, str], tmp_path: Path) -> None:
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", tmp_path)
    tests = (DEPLOY / "prometheus" / "alerts_test.yml").read_text("utf-8")
    renamed = _JOB.sub(lambda match: jobs[match[1]], tests)
    assert renamed.count('job="outbox-') == 0 and renamed != tests
    (tmp_path / "alerts_test.yml").write_text(renamed, "utf-8")
    run_promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)


def test_every_rule_is_tested_and_has_a_runbook() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text("utf-8"))
    tests = yaml.safe_load((DEPLOY / "prometheus" / "alerts_test.yml").read_text("utf-8"))
    fired = {case["alertname"] for test in tests["tests"] for case in test["alert_rule_test"]
             if case["exp_alerts"]}
    runbooks = (ROOT / "docs" / "operations.md").read_text("utf-8")
    for rule in rules["groups"][0]["rules"]:
        name = rule["alert"]
        assert name in fired, f"{name}: no promtool test makes it fire"
        assert rule["for"], name
        assert "job=" not in rule["expr"].replace(" ", ""), f"{name} names a job"
        url = rule["annotations"]["runbook_url"]
        assert url.endswith(f"docs/operations.md#{name.lower()}"), url
        assert f"\n### {name}\n" in runbooks, f"{name}: no runbook section in docs/operations.md"


def test_the_prometheus_rule_and_the_compose_config_pass_promtool(tmp_path: Path) -> None:
    rule = yaml.safe_load((DEPLOY / "kubernetes" / "prometheusrule.yaml").read_text("utf-8"))
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    run_promtool("check", "rules", "rules.yml", cwd=tmp_path)
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text("utf-8"))
    config["rule_files"] = ["rules.yml"]  # compose mounts alerts.yml at /etc/prometheus
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    run_promtool("check", "config", "prometheus.yml", cwd=tmp_path)


def dashboard_queries() -> list[str]:
    """Every panel's query, as Grafana sends it with every variable at "All"."""
    board = json.loads((DEPLOY / "grafana" / "outbox-relay.json").read_text())
    return [t["expr"].replace("$namespace", ".*").replace("$job", ".*").replace("$instance", ".*")
            .replace("$__rate_interval", "15s")
            for panel in board["panels"] for t in panel["targets"]]


def query(port: int, expr: str) -> list[object]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def consume(env: Env, inbox: Inbox, count: int) -> None:
    """A consuming service's inbox applies ``count`` messages of the test's queue."""
    with psycopg.connect(env.db_url, autocommit=True) as db:
        conn, channel = env.amqp_channel()
        try:
            deliveries = channel.consume(env.queue, inactivity_timeout=30)
            for done, (method, properties, body) in enumerate(deliveries, 1):
                assert method is not None, f"only {done - 1} of {count} messages arrived"
                inbox.handle_pika(db, channel, method, properties, body, lambda _c, _m: None)
                if done == count:
                    break
        finally:
            conn.close()


def test_prometheus_scrapes_every_metric_and_dashboard_query(env: Env, tmp_path: Path) -> None:
    prometheus = shutil.which("prometheus")
    assert prometheus, "prometheus not found: install Debian's prometheus package (./dev does)"
    relay_port, resolver_port, prom_port = free_port(), free_port(), free_port()
    # A consuming service: its inbox's metrics, served by prometheus-client's own server.
    inbox_port, inbox_registry = free_port(), CollectorRegistry()
    inbox = Inbox(f"inbox_{env.gid_prefix}", consumer="billing",
                  metrics=InboxMetrics(inbox_registry))
    with env.connect() as conn:
        inbox.migrate(conn)
    inbox_server, _ = start_http_server(inbox_port, addr="127.0.0.1", registry=inbox_registry)
    with env.connect() as conn:
        checker.insert_events(conn, env.table, 200, exchange=env.exchange,
                              routing_key=env.routing_key)
    relay = env.spawn("relay", OUTBOX_METRICS_PORT=str(relay_port), OUTBOX_METRICS_HOST="127.0.0.1",
                      OUTBOX_STATS_INTERVAL="0.5", OUTBOX_BATCH_SIZE="20")
    resolver = env.spawn("resolver", OUTBOX_METRICS_PORT=str(resolver_port),
                         OUTBOX_METRICS_HOST="127.0.0.1", OUTBOX_RESOLVER_INTERVAL="0.5",
                         OUTBOX_STATS_INTERVAL="0.5")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "rule_files:\n  - " + str(DEPLOY / "prometheus" / "alerts.yml") + "\n"
        "scrape_configs:\n"
        # Jobs and a namespace as a PodMonitor gives them, not compose's job names.
        + "".join(f"  - job_name: {job}\n    static_configs:\n"
                  f"      - targets: ['127.0.0.1:{port}']\n"
                  f"        labels: {{namespace: shop}}\n"
                  for job, port in (("orders", relay_port),
                                    ("orders-outbox-resolver", resolver_port),
                                    ("billing", inbox_port))))
    server = subprocess.Popen(
        [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("wb"))
    try:
        wait_until(lambda: outbox_count(env) == 0, 60, "the relay to publish")
        consume(env, inbox, 200)
        names = [described.name for registry in (relay_metrics.RelayMetrics().registry,
                                                 resolver_metrics.ResolverMetrics().registry,
                                                 inbox_registry)
                 for described in metrics.describe(registry)]
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
        # A healthy outbox under other job names: no rule's condition holds (an absent() on
        # a job name would, forever).
        rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text("utf-8"))
        for rule in rules["groups"][0]["rules"]:
            assert query(prom_port, rule["expr"]) == [], rule["alert"]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
        inbox_server.shutdown()
        with env.connect() as conn:
            conn.execute(sql.SQL("DROP TABLE {}, {}").format(
                sql.Identifier(inbox.table), sql.Identifier(f"{inbox.table}_keys")))
        for proc in (relay, resolver):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, log_of(proc)
