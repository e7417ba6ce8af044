"""The Kubernetes example only uses real settings with valid values, and real probe paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from relay.config import RELAY_OPTIONS, RESOLVER_OPTIONS

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "sidecar.yaml"


def containers() -> dict[str, dict[str, Any]]:
    found = {}
    for doc in yaml.safe_load_all(EXAMPLE.read_text()):
        for container in doc["spec"]["template"]["spec"]["containers"]:
            found[container["name"]] = container
    return found


def test_env_vars_are_real_options_with_valid_values() -> None:
    options = {"outbox-relay": {o.env: o for o in RELAY_OPTIONS},
               "outbox-resolver": {o.env: o for o in RESOLVER_OPTIONS}}
    for name in ("outbox-relay", "outbox-resolver"):
        container = containers()[name]
        assert container["args"] == [name]
        for var in container["env"]:
            assert var["name"] in options[name], var["name"]
            if "value" in var:
                options[name][var["name"]].parse(var["value"])


def test_probes_use_the_health_endpoints_on_the_metrics_port() -> None:
    for name in ("outbox-relay", "outbox-resolver"):
        container = containers()[name]
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        port = {v["name"]: v.get("value") for v in container["env"]}["OUTBOX_METRICS_PORT"]
        assert container["ports"][0]["containerPort"] == int(port)


def documents() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(EXAMPLE.read_text()))


def test_the_grace_period_lets_the_batch_in_flight_finish() -> None:
    (service,) = [d for d in documents() if d["metadata"]["name"] == "orders"]
    spec = service["spec"]["template"]["spec"]
    relay = containers()["outbox-relay"]
    env = {v["name"]: v.get("value") for v in relay["env"]}
    confirm = float(env.get("OUTBOX_CONFIRM_TIMEOUT") or _default("confirm_timeout"))
    # Confirms of the batch, then the ledger record's: two confirm timeouts at most.
    assert spec["terminationGracePeriodSeconds"] > 2 * confirm


def _default(dest: str) -> str:
    (option,) = [o for o in RELAY_OPTIONS if o.dest == dest]
    assert option.default is not None
    return option.default


def test_containers_run_unprivileged_on_a_read_only_root() -> None:
    for doc in documents():
        assert doc["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    for name in ("outbox-relay", "outbox-resolver"):
        context = containers()[name]["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["readOnlyRootFilesystem"] is True
        assert context["capabilities"]["drop"] == ["ALL"]


def test_relay_and_resolver_share_the_protocol_settings() -> None:
    relay = {v["name"]: v for v in containers()["outbox-relay"]["env"]}
    resolver = {v["name"]: v for v in containers()["outbox-resolver"]["env"]}
    for name in ("OUTBOX_DATABASE_URL", "OUTBOX_GID_PREFIX", "OUTBOX_LEDGER_STREAM"):
        # The same secret for the database URL: the resolver must log in as the relays' role.
        assert relay[name] == resolver[name], name
    # RabbitMQ users differ: the resolver reads the ledger, the relay publishes to exchanges.
    assert relay["OUTBOX_AMQP_URL"] != resolver["OUTBOX_AMQP_URL"]
