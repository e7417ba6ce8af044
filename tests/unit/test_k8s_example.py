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
