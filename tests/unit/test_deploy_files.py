"""The deployment files agree with the code: no Docker, no servers, no PyYAML needed.

docker-compose.yml and deploy/prometheus/prometheus.yml are kept to plain block YAML (mappings,
``- item`` lists, JSON-style flow lists, full-line comments), which the small reader below
understands; where PyYAML happens to be installed, a test checks the reader agrees with it.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest

from relay import cli as relay_cli
from relay import config
from resolver import cli as resolver_cli

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DOCKERFILE = ROOT / "Dockerfile"
PRODUCER = ROOT / "deploy" / "demo" / "producer.py"


# -- a reader for the block-YAML subset the deploy files use ------------------------------------

_KEY_RE = re.compile(r"^(?P<key>[A-Za-z0-9_][A-Za-z0-9_.-]*):(?: +(?P<rest>.*))?$")
_INT_RE = re.compile(r"^-?[0-9]+$")
# YAML 1.1 reads these as booleans: the files must quote them (as compose needs restart: "no").
_AMBIGUOUS = {"yes", "no", "on", "off", "y", "n", "true", "false", "null", "~"}


def load_yaml(text: str) -> Any:
    lines: list[tuple[int, str]] = []
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#") or stripped == "---":
            continue
        if "\t" in raw[: len(raw) - len(raw.lstrip())]:
            raise ValueError(f"line {number}: tab in indentation")
        lines.append((len(raw) - len(raw.lstrip(" ")), stripped))
    if not lines:
        return None
    value, pos = _block(lines, 0, lines[0][0])
    if pos != len(lines):
        raise ValueError(f"unexpected indentation at {lines[pos][1]!r}")
    return value


def _is_item(text: str) -> bool:
    return text == "-" or text.startswith("- ")


def _block(lines: list[tuple[int, str]], pos: int, indent: int) -> tuple[Any, int]:
    if _is_item(lines[pos][1]):
        return _sequence(lines, pos, indent)
    return _mapping(lines, pos, indent)


def _mapping(lines: list[tuple[int, str]], pos: int, indent: int) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}
    while pos < len(lines) and lines[pos][0] == indent and not _is_item(lines[pos][1]):
        match = _KEY_RE.match(lines[pos][1])
        if match is None:
            raise ValueError(f"not a 'key: value' line: {lines[pos][1]!r}")
        key, rest = match["key"], match["rest"]
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        pos += 1
        if rest:
            out[key] = _scalar(rest)
        elif pos < len(lines) and lines[pos][0] > indent:
            out[key], pos = _block(lines, pos, lines[pos][0])
        elif pos < len(lines) and lines[pos][0] == indent and _is_item(lines[pos][1]):
            out[key], pos = _sequence(lines, pos, indent)
        else:
            out[key] = None
    return out, pos


def _sequence(lines: list[tuple[int, str]], pos: int, indent: int) -> tuple[list[Any], int]:
    out: list[Any] = []
    while pos < len(lines) and lines[pos][0] == indent and _is_item(lines[pos][1]):
        text = lines[pos][1][1:].lstrip(" ")
        if _KEY_RE.match(text):
            # "- key: value" opens a mapping whose keys line up with this first one.
            lines[pos] = (indent + len(lines[pos][1]) - len(text), text)
            item, pos = _mapping(lines, pos, lines[pos][0])
        elif text:
            item, pos = _scalar(text), pos + 1
        else:
            raise ValueError("a bare '-' item is not supported")
        out.append(item)
    return out, pos


def _scalar(text: str) -> Any:
    if text[0] in "[{\"":
        return json.loads(text)  # flow lists and double-quoted strings are written as JSON
    if text[0] == "'":
        if len(text) < 2 or not text.endswith("'"):
            raise ValueError(f"unterminated quote: {text!r}")
        return text[1:-1].replace("''", "'")
    if " #" in text or text[0] in "&*!|>%@`":
        raise ValueError(f"unsupported YAML in {text!r}: quote it or move the comment")
    if text.lower() in _AMBIGUOUS:
        raise ValueError(f"{text!r} is read differently by YAML 1.1 and 1.2: quote it")
    if _INT_RE.match(text):
        return int(text)
    return text


def test_reader_reads_what_it_must() -> None:
    doc = load_yaml(
        "# c\na:\n  b: 1\n  c: [\"x\", \"y\"]\n  d:\n  - p\n  - 'q''s'\n"
        "e:\n  - f: 5s\n    g:\n      - targets: [\"h:1\"]\n  - f: t\n"
    )
    assert doc == {"a": {"b": 1, "c": ["x", "y"], "d": ["p", "q's"]},
                   "e": [{"f": "5s", "g": [{"targets": ["h:1"]}]}, {"f": "t"}]}
    for bad in ("a: no\n", "a: b # c\n", "a: &x 1\n", "a:\n  b: 1\n   c: 2\n", "a: 1\na: 2\n"):
        with pytest.raises(ValueError):
            load_yaml(bad)


@pytest.mark.parametrize("path", [COMPOSE, PROMETHEUS], ids=lambda p: p.name)
def test_reader_agrees_with_pyyaml(path: Path) -> None:
    import yaml  # a test dependency: the cross-check must run, not skip
    assert load_yaml(path.read_text("utf-8")) == yaml.safe_load(path.read_text("utf-8"))


# -- what each service runs -----------------------------------------------------------------

PROGRAMS = {"outbox-relay": "relay.cli:main", "outbox-resolver": "resolver.cli:main"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = load_yaml(COMPOSE.read_text("utf-8"))
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found = compose["services"]
    assert {"postgres", "rabbitmq", "migrate", "relay", "resolver", "producer", "prometheus",
            "grafana"} <= set(found)
    return found  # type: ignore[no-any-return]


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command")
    assert isinstance(command, list), "write commands as lists: no shell, signals reach the program"
    assert all(isinstance(part, str) for part in command)
    return command


def _program(service: dict[str, Any]) -> tuple[str, argparse.Namespace, tuple[config.Option, ...]]:
    """The program a service runs, its parsed arguments and the options it reads."""
    command = _command(service)
    program, args = command[0], command[1:]
    if program == "outbox-relay":
        seen: dict[str, argparse.Namespace] = {}

        def capture(name: str) -> Any:
            def run(namespace: argparse.Namespace) -> int:
                seen[name] = namespace
                return 0
            return run

        # relay.cli.main's own dispatch ("run" is the default), with the work replaced.
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(relay_cli, "_run", capture("run"))
            patch.setattr(relay_cli, "_migrate", capture("migrate"))
            assert relay_cli.main(args) == 0
        ((command_name, namespace),) = seen.items()
        if command_name == "migrate":
            return "outbox-relay migrate", namespace, tuple(relay_cli.MIGRATE_OPTIONS)
        return "outbox-relay", namespace, config.RELAY_OPTIONS
    if program == "outbox-resolver":
        return program, resolver_cli.build_parser().parse_args(args), config.RESOLVER_OPTIONS
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
    assert scripts == PROGRAMS


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
    _program_name, _namespace, options = _program(services[name])
    by_env = {option.env: option for option in options}
    assert len(by_env) == len(options), "two options share an environment variable"
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
    program, namespace, options = _program(service)
    values = config.resolve(namespace, options, environ=_environment(service))
    if program == "outbox-relay":
        config.RelaySettings(**values)  # the cross-checks of __post_init__
    elif program == "outbox-resolver":
        config.ResolverSettings(**values)
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


# -- the demo producer ------------------------------------------------------------------------

def producer_module() -> Any:
    """deploy/demo/producer.py, imported from its file (it is mounted, not installed)."""
    spec = importlib.util.spec_from_file_location("demo_producer", PRODUCER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_producer_runs_the_mounted_demo_script(services: dict[str, dict[str, Any]]) -> None:
    producer = services["producer"]
    assert producer["build"] == "."
    assert producer["image"] == "outbox-relay:dev"
    command = _command(producer)
    assert command[0] == "python"
    mounts = [volume.split(":") for volume in producer["volumes"]]
    assert mounts == [["./deploy/demo", "/demo", "ro"]]
    script = Path(command[1])
    assert script.parent == Path("/demo")
    assert (ROOT / "deploy" / "demo" / script.name) == PRODUCER and PRODUCER.is_file()
    assert producer["stop_signal"] == "SIGTERM"
    assert producer["restart"] == "on-failure"
    assert producer["depends_on"] == {
        "migrate": {"condition": "service_completed_successfully"},
        "rabbitmq": {"condition": "service_healthy"},
    }


def test_producer_environment_is_its_settings_and_matches_the_relay(
    services: dict[str, dict[str, Any]]
) -> None:
    module = producer_module()
    by_env = {option.env: option for option in module.OPTIONS}
    env = _environment(services["producer"])
    for key, value in env.items():
        assert key in by_env, f"producer: {key} is not read by {PRODUCER.name}"
        by_env[key].parse(value)
    args = module.build_parser().parse_args(_command(services["producer"])[2:])
    values = config.resolve(args, module.OPTIONS, environ=env)
    relay = _settings(services["relay"])
    for key in ("database_url", "amqp_url", "table"):
        assert values[key] == relay[key], key
    # The relay publishes mandatory: an event to an exchange without a bound queue fails.
    assert values["exchange"] and values["queue"]


def test_producer_help_names_every_environment_variable(capsys: pytest.CaptureFixture[str]) -> None:
    module = producer_module()
    with pytest.raises(SystemExit) as exit_info:
        module.build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in module.OPTIONS:
        assert option.flag in text and f"env {option.env}" in text


# -- Prometheus -----------------------------------------------------------------------------

def test_prometheus_scrapes_the_configured_metrics_ports(services: dict[str, dict[str, Any]]) -> None:
    prometheus = load_yaml(PROMETHEUS.read_text("utf-8"))
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert set(jobs) == {"outbox-relay", "outbox-resolver"}
    assert prometheus["global"]["scrape_interval"] == "5s"
    for job_name, service_name in (("outbox-relay", "relay"), ("outbox-resolver", "resolver")):
        job = jobs[job_name]
        assert job.get("scrape_interval", "5s") == "5s"
        assert job.get("metrics_path", "/metrics") == "/metrics"
        targets = [target for group in job["static_configs"] for target in group["targets"]]
        port = _settings(services[service_name])["metrics_port"]
        assert port > 0, f"{service_name} has its metrics endpoint disabled"
        assert targets == [f"{service_name}:{port}"]
        assert str(port) in [str(p) for p in services[service_name].get("expose", [])]


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
    defaults = {int(option.default or 0) for option in (*config.RELAY_OPTIONS, *config.RESOLVER_OPTIONS)
                if option.dest == "metrics_port"}
    assert exposed == defaults == {9460, 9461}
    env = " ".join(rest for keyword, rest in stage if keyword == "ENV")
    assert "PYTHONUNBUFFERED=1" in env


# -- Grafana ----------------------------------------------------------------------------------

DASHBOARD = ROOT / "deploy" / "grafana" / "outbox-relay.json"


def readme_metrics() -> set[str]:
    text = (ROOT / "README.md").read_text("utf-8")
    return set(re.findall(r"^\| `(outbox_[a-z_]+)(?:\{[a-z_,]+\})?` \|", text, re.M))


def test_dashboard_is_built_on_the_documented_metrics_only() -> None:
    board = json.loads(DASHBOARD.read_text("utf-8"))
    used: set[str] = set()
    for panel in board["panels"]:
        assert panel["description"], panel["title"]
        for target in panel["targets"]:
            names = re.findall(r"\b(outbox_[a-z_]+)", target["expr"])
            used |= {re.sub(r"_(bucket|count|sum)$", "", name) for name in names}
    documented = readme_metrics()
    assert len(documented) > 15
    assert used <= documented, used - documented
    # The operator's questions of the issue each have a panel.
    for name in ("outbox_relay_events_published_total", "outbox_relay_lag_seconds",
                 "outbox_relay_backlog_events", "outbox_relay_batch_duration_seconds",
                 "outbox_relay_publish_failures_total", "outbox_relay_dead_lettered_total",
                 "outbox_relay_reconnects_total", "outbox_prepared_transactions",
                 "outbox_prepared_oldest_age_seconds", "outbox_resolver_decisions_total",
                 "outbox_prepared_holding_vacuum_age_seconds",
                 "outbox_xmin_horizon_age_transactions"):
        assert name in used, name


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
    import yaml  # Grafana's own files are not kept to the subset load_yaml reads
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
