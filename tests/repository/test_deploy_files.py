"""The deployment files agree with the code: no Docker engine, no servers.

docker-compose.yml is read with PyYAML as compose reads it (anchors, ``<<`` merge keys), and
each service's command and environment is resolved by the programs' own option parsing. The
healthchecks run against a real metrics server of this process.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from outbox_relay.inbox_metrics import InboxMetrics
from outbox_relay.relay import cli as relay_cli
from outbox_relay.relay import metrics as relay_metrics
from outbox_relay.relay import settings as relay_settings
from outbox_relay.resolver import cli as resolver_cli
from outbox_relay.resolver import metrics as resolver_metrics
from outbox_relay.resolver import settings as resolver_settings
from outbox_relay.runtime import http, metrics, options
from outbox_relay.runtime.health import Health

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DOCKERFILE = ROOT / "Dockerfile"
PRODUCER = ROOT / "deploy" / "demo" / "producer.py"
CONSUMER = ROOT / "deploy" / "demo" / "consumer.py"


# -- what each service runs -----------------------------------------------------------------

PROGRAMS = {"outbox-relay": "outbox_relay.relay.cli:main",
            "outbox-resolver": "outbox_relay.resolver.cli:main"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text("utf-8"))
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found = compose["services"]
    assert {"postgres", "rabbitmq", "migrate", "relay", "resolver", "producer", "consumer",
            "prometheus", "grafana"} <= set(found)
    return found  # type: ignore[no-any-return]


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command")
    assert isinstance(command, list), "write commands as lists: no shell, signals reach the program"
    assert all(isinstance(part, str) for part in command)
    return command


def _program(service: dict[str, Any]) -> tuple[str, argparse.Namespace, tuple[options.Option, ...]]:
    """The program a service runs, its parsed arguments and the options it reads."""
    command = _command(service)
    program, args = command[0], command[1:]
    if program == "outbox-relay":
        seen: dict[str, argparse.Namespace] = {}

        def capture(name: str) -> Any:
            def run(namespace: argparse.Namespace, *_fault: Any) -> int:  # _run takes a hook
                seen[name] = namespace
                return 0
            return run

        # outbox_relay.relay.cli.main's own dispatch ("run" is the default), with the work replaced.
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(relay_cli, "_run", capture("run"))
            patch.setattr(relay_cli, "_migrate", capture("migrate"))
            assert relay_cli.main(args) == 0
        ((command_name, namespace),) = seen.items()
        if command_name == "migrate":
            return "outbox-relay migrate", namespace, tuple(relay_cli.MIGRATE_OPTIONS)
        return "outbox-relay", namespace, relay_settings.RELAY_OPTIONS
    if program == "outbox-resolver":
        return program, resolver_cli.build_parser().parse_args(args), resolver_settings.RESOLVER_OPTIONS
    raise AssertionError(f"{program!r} is not one of {sorted(PROGRAMS)}")


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    assert isinstance(env, dict), "write environment as a mapping"
    for name, value in env.items():
        assert isinstance(value, str), f"{name}: quote the value, compose passes text"
        assert "$" not in value, f"{name}: compose would interpolate {value!r}"
    return env


RUNS = {
    "migrate": "outbox-relay migrate",
    "relay": "outbox-relay",
    "resolver": "outbox-resolver",
}


def test_console_scripts_exist() -> None:
    text = (ROOT / "pyproject.toml").read_text("utf-8")
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    scripts = dict(re.findall(r'^\s*"?([\w.-]+)"?\s*=\s*"([^"]+)"', section, re.M))
    # The two programs, and the consumers' inbox tool (not a service of the deployment).
    assert scripts == {**PROGRAMS, "outbox-inbox": "outbox_relay.inbox_cli:main"}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_service_runs_a_real_command(services: dict[str, dict[str, Any]], name: str) -> None:
    program, _namespace, _options = _program(services[name])
    assert program == RUNS[name]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_service_uses_the_project_image(services: dict[str, dict[str, Any]], name: str) -> None:
    assert services[name]["build"] == "."
    assert services[name]["image"] == "outbox-relay:dev"


@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_outbox_variable_is_an_option_with_a_valid_value(
    services: dict[str, dict[str, Any]], name: str
) -> None:
    _program_name, _namespace, declared = _program(services[name])
    by_env = {option.env: option for option in declared}
    assert len(by_env) == len(declared), "two options share an environment variable"
    env = _environment(services[name])
    assert any(key.startswith("OUTBOX_") for key in env)
    for key, value in env.items():
        if not key.startswith("OUTBOX_"):
            continue
        assert key in by_env, f"{name}: {key} is not read by {RUNS[name]}"
        try:
            by_env[key].parse(value)
        except ValueError as exc:
            raise AssertionError(f"{name}: {key}={value!r} is refused: {exc}") from None


def _settings(service: dict[str, Any]) -> dict[str, Any]:
    """What the program resolves from its command line and this environment alone."""
    program, namespace, declared = _program(service)
    values = options.resolve(namespace, declared, environ=_environment(service))
    if program == "outbox-relay":
        relay_settings.RelaySettings(**values)  # the cross-checks of __post_init__
    elif program == "outbox-resolver":
        resolver_settings.ResolverSettings(**values)
    return values


@pytest.mark.parametrize("name", sorted(RUNS))
def test_service_configuration_resolves(services: dict[str, dict[str, Any]], name: str) -> None:
    _settings(services[name])  # raises ConfigError with one line naming the setting


def test_relay_and_resolver_share_the_protocol_settings(services: dict[str, dict[str, Any]]) -> None:
    relay = _settings(services["relay"])
    resolver = _settings(services["resolver"])
    migrate = _settings(services["migrate"])
    for key in ("database_url", "amqp_url", "gid_prefix", "ledger_stream", "ledger_max_age"):
        assert relay[key] == resolver[key], key
    assert migrate["database_url"] == relay["database_url"]
    assert migrate["table"] == relay["table"]
    # A healthy relay's batch is never resolved from under it.
    assert resolver["hard_limit"] > relay["confirm_timeout"]


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"([0-9]+)(ms|s|m|h)", duration)
    assert match, f"unsupported duration {duration!r}"
    return int(match[1]) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[match[2]]


@pytest.mark.parametrize("name", ["relay", "resolver"])
def test_long_running_services_stop_gracefully(services: dict[str, dict[str, Any]], name: str) -> None:
    service = services[name]
    assert service["stop_signal"] == "SIGTERM"
    grace = _seconds(service["stop_grace_period"])
    assert grace >= 10
    if name == "relay":
        # The batch in flight waits for its confirms, then its ledger record's: it is committed
        # or rolled back before the SIGKILL.
        assert 2 * _settings(service)["confirm_timeout"] < grace


def test_dependencies(services: dict[str, dict[str, Any]]) -> None:
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["migrate"]["restart"] == "no"
    assert services["relay"]["depends_on"] == {
        "migrate": {"condition": "service_completed_successfully"},
        "rabbitmq": {"condition": "service_healthy"},
    }
    assert services["resolver"]["depends_on"]["postgres"] == {"condition": "service_healthy"}
    for name in ("postgres", "rabbitmq"):
        assert services[name]["healthcheck"]["test"]
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert services["rabbitmq"]["healthcheck"]["test"][1:] == ["rabbitmq-diagnostics", "-q", "ping"]


def test_postgres_enables_two_phase_commit(services: dict[str, dict[str, Any]]) -> None:
    command = _command(services["postgres"])
    assert command[0] == "postgres"
    assert services["postgres"]["image"].startswith("postgres:")
    settings = dict(value.split("=", 1) for flag, value in itertools.pairwise(command) if flag == "-c")
    assert int(settings["max_prepared_transactions"]) > 0
    assert int(settings["max_prepared_transactions"]) <= int(settings.get("max_connections", "100"))


def test_urls_point_at_the_compose_servers(services: dict[str, dict[str, Any]]) -> None:
    postgres_env = _environment(services["postgres"])
    rabbit_env = _environment(services["rabbitmq"])
    for name in ("relay", "resolver"):
        values = _settings(services[name])
        assert values["database_url"] == (
            f"postgresql://{postgres_env['POSTGRES_USER']}:{postgres_env['POSTGRES_PASSWORD']}"
            f"@postgres:5432/{postgres_env['POSTGRES_DB']}"
        )
        assert values["amqp_url"].startswith(
            f"amqp://{rabbit_env['RABBITMQ_DEFAULT_USER']}:{rabbit_env['RABBITMQ_DEFAULT_PASS']}"
            "@rabbitmq:5672/"
        )


# -- the demo producer and consumer ----------------------------------------------------------

def demo_module(path: Path) -> Any:
    """A script of deploy/demo/, imported from its file (it is mounted, not installed)."""
    spec = importlib.util.spec_from_file_location(f"demo_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def producer_module() -> Any:
    return demo_module(PRODUCER)


@pytest.mark.parametrize(("name", "script", "depends_on"), [
    ("producer", PRODUCER, {"migrate": {"condition": "service_completed_successfully"},
                            "rabbitmq": {"condition": "service_healthy"}}),
    ("consumer", CONSUMER, {"rabbitmq": {"condition": "service_healthy"}}),
])
def test_demo_services_run_the_mounted_demo_scripts(
    services: dict[str, dict[str, Any]], name: str, script: Path, depends_on: dict[str, Any]
) -> None:
    service = services[name]
    assert service["build"] == "."
    assert service["image"] == "outbox-relay:dev"
    command = _command(service)
    assert command[0] == "python"
    mounts = [volume.split(":") for volume in service["volumes"]]
    assert mounts == [["./deploy/demo", "/demo", "ro"]]
    mounted = Path(command[1])
    assert mounted.parent == Path("/demo")
    assert (ROOT / "deploy" / "demo" / mounted.name) == script and script.is_file()
    assert service["stop_signal"] == "SIGTERM"
    assert service["restart"] == "on-failure"
    assert service["depends_on"] == depends_on


def _demo_values(services: dict[str, dict[str, Any]], name: str, script: Path) -> dict[str, Any]:
    module = demo_module(script)
    by_env = {option.env: option for option in module.OPTIONS}
    env = _environment(services[name])
    for key, value in env.items():
        assert key in by_env, f"{name}: {key} is not read by {script.name}"
        by_env[key].parse(value)
    args = module.build_parser().parse_args(_command(services[name])[2:])
    return options.resolve(args, module.OPTIONS, environ=env)  # type: ignore[no-any-return]


def test_demo_environment_is_their_settings_and_matches_the_relay(
    services: dict[str, dict[str, Any]]
) -> None:
    producer = _demo_values(services, "producer", PRODUCER)
    consumer = _demo_values(services, "consumer", CONSUMER)
    relay = _settings(services["relay"])
    for key in ("database_url", "amqp_url", "table"):
        assert producer[key] == relay[key], key
    # The relay publishes mandatory: an event to an exchange without a bound queue fails.
    assert producer["exchange"] and producer["queue"]
    # The consumer reads what the producer's events are routed to.
    assert consumer["queue"] == producer["queue"]
    assert consumer["amqp_url"] == relay["amqp_url"]


@pytest.mark.parametrize("script", [PRODUCER, CONSUMER], ids=lambda p: p.name)
def test_demo_help_names_every_environment_variable(
    capsys: pytest.CaptureFixture[str], script: Path
) -> None:
    module = demo_module(script)
    with pytest.raises(SystemExit) as exit_info:
        module.build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in module.OPTIONS:
        assert option.flag in text and f"env {option.env}" in text


def test_the_consumer_drops_copies_by_message_id() -> None:
    dedup = demo_module(CONSUMER).Dedup(limit=2)
    seen = [dedup.first_time(i) for i in ("a", "b", "a", "c", "a", "b", None)]
    # It remembers the 2 ids seen last: "a" (seen again) stays, "b" is forgotten for "c".
    assert seen == [True, True, False, True, False, True, True]
    assert (dedup.received, dedup.duplicates) == (5, 2)


# -- several relays, healthchecks -----------------------------------------------------------

def test_compose_writes_the_shared_settings_once(compose: dict[str, Any]) -> None:
    text = COMPOSE.read_text("utf-8")
    for value in ("postgresql://outbox:outbox@postgres:5432/outbox",
                  "amqp://outbox:outbox@rabbitmq:5672/%2F", "outbox.ledger"):
        assert text.count(value) == 1, value
    assert "x-database" in compose and "x-broker" in compose and "x-protocol" in compose


def test_the_relay_can_be_scaled(services: dict[str, dict[str, Any]]) -> None:
    relay = services["relay"]
    # A fixed host port (or name) makes `docker compose up --scale relay=3` fail on the second.
    assert "ports" not in relay and "container_name" not in relay
    prometheus = yaml.safe_load(PROMETHEUS.read_text("utf-8"))
    (job,) = [j for j in prometheus["scrape_configs"] if j["job_name"] == "outbox-relay"]
    # Every replica is scraped: Docker's DNS answers the service name with all of them.
    assert job["dns_sd_configs"] == [{"names": ["relay"], "type": "A",
                                      "port": _settings(relay)["metrics_port"],
                                      "refresh_interval": "5s"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("name", ["relay", "resolver"])
def test_healthchecks_ask_readyz_and_work_in_the_image(
    services: dict[str, dict[str, Any]], name: str
) -> None:
    check = services[name]["healthcheck"]
    test = check["test"]
    port = _settings(services[name])["metrics_port"]
    assert test[:3] == ["CMD", "python", "-c"], "the image has Python, no curl or wget"
    assert f"http://127.0.0.1:{port}/readyz" in test[3]
    # The same command against a real metrics server: exit 0 when ready, not when not.
    health = Health(("postgresql",), stall_after=30)
    served = _free_port()
    server = http.serve(resolver_metrics.ResolverMetrics().registry, "127.0.0.1", served, health)
    assert server is not None
    try:
        command = [sys.executable, "-c", test[3].replace(f":{port}/", f":{served}/")]
        assert subprocess.run(command, capture_output=True, timeout=30).returncode != 0
        health.set_check("postgresql", None)
        assert subprocess.run(command, capture_output=True, timeout=30).returncode == 0
    finally:
        server.shutdown()
        server.server_close()


# -- Prometheus -----------------------------------------------------------------------------

def test_prometheus_scrapes_the_configured_metrics_ports(services: dict[str, dict[str, Any]]) -> None:
    prometheus = yaml.safe_load(PROMETHEUS.read_text("utf-8"))
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert set(jobs) == {"outbox-relay", "outbox-resolver"}
    assert prometheus["global"]["scrape_interval"] == "5s"
    for job_name, service_name in (("outbox-relay", "relay"), ("outbox-resolver", "resolver")):
        job = jobs[job_name]
        assert job.get("scrape_interval", "5s") == "5s"
        assert job.get("metrics_path", "/metrics") == "/metrics"
        port = _settings(services[service_name])["metrics_port"]
        assert port > 0, f"{service_name} has its metrics endpoint disabled"
        targets = [t for group in job.get("static_configs", []) for t in group["targets"]]
        targets += [f"{n}:{d['port']}" for d in job.get("dns_sd_configs", []) for n in d["names"]]
        assert targets == [f"{service_name}:{port}"]
        assert str(port) in [str(p) for p in services[service_name].get("expose", [])]
        # Prometheus is another container: the program listens on every address of its own
        # (the program's default is loopback; the image sets it too, compose says so itself).
        assert _settings(services[service_name])["metrics_host"] == "0.0.0.0"


def test_prometheus_mounts_the_config(services: dict[str, dict[str, Any]]) -> None:
    volumes = services["prometheus"]["volumes"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in volumes
    assert services["prometheus"]["image"].startswith("prom/prometheus")


# -- Dockerfile -----------------------------------------------------------------------------

def _final_stage() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text("utf-8").replace("\\\n", " ")
    instructions = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            keyword, _, rest = stripped.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def test_dockerfile_runs_as_a_non_root_user() -> None:
    users = [rest for keyword, rest in _final_stage() if keyword == "USER"]
    assert users, "the final stage sets no USER, so the programs run as root"
    user, _, group = users[-1].partition(":")
    assert user not in ("root", "0") and group not in ("root", "0")


def test_dockerfile_runs_either_program() -> None:
    stage = _final_stage()
    assert stage[0][1].startswith("python:3.11-slim")
    assert not [rest for keyword, rest in stage if keyword == "ENTRYPOINT"]
    cmds = [json.loads(rest) for keyword, rest in stage if keyword == "CMD"]
    assert cmds[-1] == ["outbox-relay"]
    exposed = {int(port) for keyword, rest in stage if keyword == "EXPOSE" for port in rest.split()}
    defaults = {int(option.default or 0)
                for option in (*relay_settings.RELAY_OPTIONS, *resolver_settings.RESOLVER_OPTIONS)
                if option.dest == "metrics_port"}
    assert exposed == defaults == {9460, 9461}
    env = " ".join(rest for keyword, rest in stage if keyword == "ENV")
    assert "PYTHONUNBUFFERED=1" in env


def test_the_programs_listen_on_loopback_unless_told_and_the_image_tells_them() -> None:
    """Off a container, /metrics and the probes stay on the machine unless asked for; in one,
    the scraper and the kubelet come from outside it, so the image listens on every address."""
    assert options.METRICS_HOST.default == "127.0.0.1"
    env = [rest for keyword, rest in _final_stage() if keyword == "ENV"]
    assert "OUTBOX_METRICS_HOST=0.0.0.0" in " ".join(env).split()


# -- Grafana ----------------------------------------------------------------------------------

DASHBOARD = ROOT / "deploy" / "grafana" / "outbox-relay.json"


def declared_metrics() -> set[str]:
    """The metrics both programs declare, and the inbox's (a consuming service's):
    docs/operations.md's table is generated from these."""
    inbox = CollectorRegistry()
    InboxMetrics(inbox)
    return {described.name for registry in (relay_metrics.RelayMetrics().registry,
                                            resolver_metrics.ResolverMetrics().registry, inbox)
            for described in metrics.describe(registry)}


def test_dashboard_is_built_on_the_declared_metrics_only() -> None:
    board = json.loads(DASHBOARD.read_text("utf-8"))
    used: set[str] = set()
    for panel in board["panels"]:
        assert panel["description"], panel["title"]
        for target in panel["targets"]:
            names = re.findall(r"\b(outbox_[a-z_]+)", target["expr"])
            used |= {re.sub(r"_(bucket|count|sum)$", "", name) for name in names}
    declared = declared_metrics()
    assert len(declared) > 15
    assert used <= declared, used - declared
    # The operator's questions of the issue each have a panel.
    for name in ("outbox_relay_events_published_total", "outbox_relay_lag_seconds",
                 "outbox_relay_backlog_events", "outbox_relay_batch_duration_seconds",
                 "outbox_relay_row_failures_total", "outbox_relay_batch_failures_total",
                 "outbox_relay_dead_lettered_total",
                 "outbox_relay_reconnects_total", "outbox_prepared_transactions",
                 "outbox_prepared_oldest_age_seconds", "outbox_resolver_decisions_total",
                 "outbox_prepared_holding_vacuum_age_seconds",
                 "outbox_xmin_horizon_age_transactions",
                 # the consumers' side (issue 35)
                 "outbox_inbox_event_age_seconds", "outbox_inbox_messages_total",
                 "outbox_inbox_handler_duration_seconds"):
        assert name in used, name


def test_every_dashboard_query_keeps_the_outboxes_apart() -> None:
    board = json.loads(DASHBOARD.read_text("utf-8"))
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert {"datasource", "namespace", "job", "instance"} <= set(variables)
    for name in ("namespace", "job", "instance"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    for panel in board["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            # Every selector is filtered by the three variables; nothing names a job.
            selectors = re.findall(r"\b[a-z_]+\{([^}]*)\}", expr)
            assert selectors, expr
            for selector in selectors:
                for name in ("namespace", "job", "instance"):
                    assert f'{name}=~"${name}"' in selector, expr
            assert 'job="' not in expr
            # Rates over Grafana's interval, never a hard-coded one.
            for window in re.findall(r"rate\([^\[]*\[([^\]]+)\]", expr):
                assert window == "$__rate_interval", expr
            # Aggregations keep which outbox it is.
            for grouping in re.findall(r"\b(?:sum|max|min|count)\s+by\s*\(([^)]*)\)", expr):
                assert "job" in grouping, expr


def _alert_levels() -> dict[str, float]:
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text("utf-8"))
    levels = {}
    for rule in rules["groups"][0]["rules"]:
        found = re.findall(r"> ([0-9]+)\b", rule["expr"])
        if found:
            levels[rule["alert"]] = max(float(n) for n in found)
    return levels


@pytest.mark.parametrize(("title", "alert"), [
    ("Lag (oldest unpublished event)", "OutboxLagHigh"),
    ("Backlog", "OutboxBacklogGrowing"),
    ("Oldest prepared transaction", "OutboxPreparedTransactionInDoubt"),
    ("Oldest transaction of another session", "OutboxVacuumHeldBySession"),
    ("Since last resolver scan", "OutboxResolverNotRunning"),
    ("Inbox: event age when applied p50 / p99", "OutboxEventAgeHigh"),
])
def test_dashboard_thresholds_are_the_alert_levels(title: str, alert: str) -> None:
    panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text("utf-8"))["panels"]}
    steps = panels[title]["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[-1]["color"] == "red"
    assert steps[-1]["value"] == _alert_levels()[alert]
    # The alert's threshold also appears in the panel's description for a reader.
    assert f"{_alert_levels()[alert]:,.0f}" in panels[title]["description"]


def test_the_dashboard_shows_memory_and_cpu_of_our_processes_only() -> None:
    exprs = " ".join(t["expr"] for p in json.loads(DASHBOARD.read_text("utf-8"))["panels"]
                     for t in p["targets"])
    for standard in ("process_resident_memory_bytes", "process_cpu_seconds_total"):
        assert re.search(standard + r"\{[^}]*\}(\[[^]]*\])?\)? and on \(namespace, job, instance\)",
                         exprs), standard


def test_dashboard_panels_have_unique_ids_and_do_not_overlap() -> None:
    panels = json.loads(DASHBOARD.read_text("utf-8"))["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_grafana_provisions_the_dashboard_and_the_prometheus_datasource(
    services: dict[str, dict[str, Any]]
) -> None:
    provisioning = ROOT / "deploy" / "grafana" / "provisioning"
    providers = yaml.safe_load((provisioning / "dashboards" / "outbox.yml").read_text("utf-8"))
    (provider,) = providers["providers"]
    mounts = dict(volume.rsplit(":", 1)[0].split(":", 1) for volume in services["grafana"]["volumes"])
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    assert Path(mounts["./deploy/grafana/outbox-relay.json"]).parent == Path(
        provider["options"]["path"])
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text("utf-8"))
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    assert "127.0.0.1:9090:9090" in services["prometheus"]["ports"]
