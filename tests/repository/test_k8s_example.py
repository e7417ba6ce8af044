"""The Kubernetes example (deploy/kubernetes/) is valid against the Kubernetes schemas (offline,
with kubernetes-validate), passes the "restricted" Pod Security Standard, and uses only real
settings with valid values, real probe paths and the secrets it mounts; the inbox's retention
runs as a CronJob (inbox-prune.yaml). No cluster needed."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from outbox_relay import inbox_cli
from outbox_relay.relay import cli as relay_cli
from outbox_relay.relay import settings as relay_settings
from outbox_relay.resolver import settings as resolver_settings
from outbox_relay.runtime import options

KUBERNETES = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
SIDECAR = KUBERNETES / "sidecar.yaml"
INBOX_PRUNE = KUBERNETES / "inbox-prune.yaml"
# Native sidecars (an init container with restartPolicy: Always) are on by default from 1.29.
KUBERNETES_VERSION = "1.29.0"

PROGRAMS: dict[str, tuple[options.Option[Any], ...]] = {
    "outbox-relay": relay_settings.RELAY_OPTIONS,
    "outbox-resolver": resolver_settings.RESOLVER_OPTIONS,
    "outbox-relay migrate": tuple(relay_cli.MIGRATE_OPTIONS),
}


def documents(path: Path = SIDECAR) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text("utf-8")) if doc]


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents() if d["kind"] == kind}


def pod_specs(path: Path = SIDECAR) -> dict[str, dict[str, Any]]:
    """Every pod template of a manifest file, by its workload's name."""
    specs = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in documents(path)
             if d["kind"] in ("Deployment", "Job")}
    specs.update({d["metadata"]["name"]: d["spec"]["jobTemplate"]["spec"]["template"]["spec"]
                  for d in documents(path) if d["kind"] == "CronJob"})
    return specs


def all_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def ours() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """{program: (container, pod spec)} for the containers that run the project's image."""
    found = {}
    for spec in pod_specs().values():
        for container in all_containers(spec):
            if container["image"].startswith("outbox-relay:"):
                found[" ".join(container["args"])] = (container, spec)
    assert set(found) == set(PROGRAMS)
    return found


def env(container: dict[str, Any]) -> dict[str, str]:
    return {var["name"]: var["value"] for var in container["env"]}


@pytest.mark.parametrize("path", sorted(KUBERNETES.glob("*.yaml")), ids=lambda p: p.name)
def test_manifests_validate_against_the_kubernetes_schemas(path: Path) -> None:
    for doc in documents(path):
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema ships with Kubernetes (checked below and by promtool)
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("path", [SIDECAR, INBOX_PRUNE], ids=lambda p: p.name)
def test_every_pod_passes_the_restricted_pod_security_standard(path: Path) -> None:
    for name, spec in pod_specs(path).items():
        context = spec["securityContext"]
        assert context["runAsNonRoot"] is True, name
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec["automountServiceAccountToken"] is False, name
        assert not {"hostNetwork", "hostPID", "hostIPC"} & set(spec), name
        for volume in spec.get("volumes", []):
            assert set(volume) <= {"name", "secret", "configMap", "emptyDir", "projected"}, volume
        for container in all_containers(spec):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, container["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], container["name"]
            assert not sc.get("capabilities", {}).get("add"), container["name"]
            assert not sc.get("privileged"), container["name"]


def test_our_containers_run_on_a_read_only_root_with_resources() -> None:
    for program, (container, _spec) in ours().items():
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, program
        resources = container["resources"]
        assert resources["requests"]["cpu"] and resources["requests"]["memory"], program
        assert resources["limits"]["memory"], program


def test_env_vars_are_real_options_with_valid_values_and_secrets_come_from_files() -> None:
    for program, (container, spec) in ours().items():
        check_env(program, container, spec, PROGRAMS[program])


def check_env(program: str, container: dict[str, Any], spec: dict[str, Any],
              program_options: tuple[options.Option[Any], ...]) -> None:
    """Every variable is a real option of the program with a valid value; a secret comes from
    a file of a mounted Secret; every required option is given."""
    by_env = {o.env: o for o in program_options}
    mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
    secrets = {v["name"]: v["secret"] for v in spec.get("volumes", []) if "secret" in v}
    for var in container["env"]:
        assert "valueFrom" not in var, f"{program}: {var['name']} from an env var, not a file"
        name, value = var["name"], var["value"]
        assert name in options.env_names(program_options), f"{program}: {name}"
        if name.endswith("_FILE"):
            assert name.removesuffix("_FILE") in by_env and by_env[name.removesuffix("_FILE")].secret
            # The file is a key of a mounted secret volume.
            path = PurePosixPath(value)
            (volume,) = [v for v, mount in mounts.items() if PurePosixPath(mount) == path.parent]
            assert path.name in [item["path"] for item in secrets[volume]["items"]], value
        else:
            by_env[name].parse(value)
    required = {o.env for o in program_options if o.default is None}
    given = {n.removesuffix("_FILE") for n in env(container)}
    assert required <= given, program


def test_the_relay_is_a_native_sidecar_without_a_readiness_probe() -> None:
    container, spec = ours()["outbox-relay"]
    assert container in spec["initContainers"]
    assert container["restartPolicy"] == "Always"
    assert "readinessProbe" not in container
    assert "startupProbe" not in container  # the service's container starts once it runs
    # The service's own container is a regular one: it starts after the relay, stops before it.
    assert [c["name"] for c in spec["containers"]] == ["orders"]


def test_probes_use_the_health_endpoints_on_the_metrics_port() -> None:
    for program in ("outbox-relay", "outbox-resolver"):
        container, _spec = ours()[program]
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "outbox-metrics"}
        (port,) = container["ports"]
        assert port["name"] == "outbox-metrics"
        assert port["containerPort"] == int(env(container)["OUTBOX_METRICS_PORT"])
        # The kubelet and Prometheus reach the pod's IP: not the program's loopback default.
        assert env(container)["OUTBOX_METRICS_HOST"] == "0.0.0.0"
    resolver, _spec = ours()["outbox-resolver"]
    assert resolver["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "outbox-metrics"}


def test_the_grace_period_lets_the_batch_in_flight_finish() -> None:
    container, spec = ours()["outbox-relay"]
    confirm = float(env(container).get("OUTBOX_CONFIRM_TIMEOUT")
                    or relay_settings.CONFIRM_TIMEOUT.default or 0)
    # Confirms of the batch, then the ledger record's: two confirm timeouts at most.
    assert spec["terminationGracePeriodSeconds"] > 2 * confirm


def test_relay_and_resolver_share_the_protocol_settings() -> None:
    relay, relay_pod = ours()["outbox-relay"]
    resolver, resolver_pod = ours()["outbox-resolver"]
    for name in ("OUTBOX_GID_PREFIX", "OUTBOX_LEDGER_STREAM", "OUTBOX_TABLE"):
        assert env(relay)[name] == env(resolver)[name], name

    def secret_key(container: dict[str, Any], pod: dict[str, Any], variable: str) -> str:
        path = PurePosixPath(env(container)[variable])
        (volume,) = [v for v in pod["volumes"] if "secret" in v]
        (item,) = [i for i in volume["secret"]["items"] if i["path"] == path.name]
        return f"{volume['secret']['secretName']}/{item['key']}"

    # The same database secret: the resolver must log in as the relays' role.
    assert (secret_key(relay, relay_pod, "OUTBOX_DATABASE_URL_FILE")
            == secret_key(resolver, resolver_pod, "OUTBOX_DATABASE_URL_FILE"))
    # RabbitMQ users differ: the resolver reads the ledger, the relay publishes to exchanges.
    assert (secret_key(relay, relay_pod, "OUTBOX_AMQP_URL_FILE")
            != secret_key(resolver, resolver_pod, "OUTBOX_AMQP_URL_FILE"))


def test_the_migrate_job_runs_migrate_as_the_migrate_role() -> None:
    (job,) = by_kind("Job").values()
    container, spec = ours()["outbox-relay migrate"]
    assert spec["restartPolicy"] in ("OnFailure", "Never")
    assert job["spec"]["backoffLimit"] > 0
    assert env(container)["OUTBOX_DATABASE_URL_FILE"].endswith("migrate-database-url")
    relay, _pod = ours()["outbox-relay"]
    assert env(container)["OUTBOX_TABLE"] == env(relay)["OUTBOX_TABLE"]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_network_policies_open_each_metrics_port_to_prometheus_only() -> None:
    policies = by_kind("NetworkPolicy").values()
    for name, workload in {**by_kind("Deployment")}.items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        spec = workload["spec"]["template"]["spec"]
        (policy,) = [p for p in policies if _selects(p["spec"]["podSelector"], labels)]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        metrics_rules = [r for r in policy["spec"]["ingress"]
                         if {"port": "outbox-metrics"} in r.get("ports", [])]
        assert len(metrics_rules) == 1, name
        (source,) = metrics_rules[0]["from"]
        assert source["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
        # Every other port the pod serves stays open (a policy would otherwise close it).
        ports = {p["name"] for c in all_containers(spec) for p in c.get("ports", [])}
        opened = {p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]}
        assert opened == ports, name


def test_the_pod_monitor_scrapes_every_relay_and_resolver_pod_by_job() -> None:
    (monitor,) = documents(KUBERNETES / "podmonitor.yaml")
    assert monitor["kind"] == "PodMonitor" and monitor["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitor["spec"]
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for program in ("outbox-relay", "outbox-resolver"):
        container, _spec = ours()[program]
        (workload,) = [d for d in by_kind("Deployment").values()
                       if container in all_containers(d["spec"]["template"]["spec"])]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert _selects(spec["selector"], labels), program
        assert spec["jobLabel"] in labels, program
        assert endpoint["port"] in [p["name"] for p in container["ports"]]


def test_the_prometheus_rule_holds_the_alert_rules() -> None:
    (rule,) = documents(KUBERNETES / "prometheusrule.yaml")
    assert rule["kind"] == "PrometheusRule" and rule["apiVersion"] == "monitoring.coreos.com/v1"
    alerts = yaml.safe_load((KUBERNETES.parent / "prometheus" / "alerts.yml").read_text("utf-8"))
    assert rule["spec"]["groups"] == alerts["groups"]
    # The Prometheus Operator selects both by the same label.
    (monitor,) = documents(KUBERNETES / "podmonitor.yaml")
    assert rule["metadata"]["labels"]["release"] == monitor["metadata"]["labels"]["release"]


def test_the_inbox_is_pruned_daily_by_a_cron_job_with_real_settings() -> None:
    (cron,) = documents(INBOX_PRUNE)
    assert cron["kind"] == "CronJob"
    spec = cron["spec"]
    minute, hour, *every = spec["schedule"].split()
    assert every == ["*", "*", "*"] and 0 < int(minute) < 60 and 0 <= int(hour) < 24  # daily
    assert spec["concurrencyPolicy"] == "Forbid"  # two runs never delete side by side
    job = spec["jobTemplate"]["spec"]
    assert job["backoffLimit"] > 0
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] in ("OnFailure", "Never")
    (container,) = pod["containers"]
    assert container["args"] == ["outbox-inbox", "prune"]
    assert container["image"].startswith("outbox-relay:")
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"]["limits"]["memory"]
    check_env("outbox-inbox prune", container, pod, inbox_cli.INBOX_OPTIONS)
    # The documented window: at least the relay's ledger retention (docs/python-api.md).
    retention = inbox_cli.age_seconds(env(container)["OUTBOX_INBOX_RETENTION"])
    assert retention >= inbox_cli.age_seconds(options.LEDGER_MAX_AGE.default or "")
