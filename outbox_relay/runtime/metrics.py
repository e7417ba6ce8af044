"""What the metrics of both programs share: the standard collectors every Prometheus client
exports, the version their build_info reports, and the docs' description of a registry.

Each program declares its own metrics on its own registry (outbox_relay.relay.metrics,
outbox_relay.resolver.metrics); outbox_relay.runtime.http serves it.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from outbox_relay.model import Server
from outbox_relay.version import __version__

SERVERS = tuple(Server)


def version() -> str:
    """The version the build_info metrics report: outbox_relay.version, written in one place."""
    return __version__


def standard_collectors(registry: CollectorRegistry) -> None:
    """What every Prometheus client exports by default (process_* RSS, CPU, open files;
    python_info; python_gc_*), on this program's own registry."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


@dataclass(frozen=True)
class Described:
    """One metric family as the docs show it (docs/operations.md is generated from these)."""

    name: str  # as exposed: counters with _total, info with _info
    type: str
    help: str
    labels: tuple[str, ...]
    label_values: dict[str, tuple[str, ...]]  # the values the code pre-declares


def describe(registry: CollectorRegistry) -> list[Described]:
    """The outbox_* metric families of a registry, in the order they were created."""
    found = []
    for family in registry.collect():
        if not family.name.startswith("outbox_"):
            continue  # the standard process_*, python_* collectors
        suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
        labels: dict[str, list[str]] = {}
        for sample in family.samples:
            for label, value in sample.labels.items():
                if label != "le" and value not in labels.setdefault(label, []):
                    labels[label].append(value)
        values = {} if family.type == "info" else {k: tuple(v) for k, v in labels.items() if v}
        found.append(Described(family.name + suffix, family.type, family.documentation,
                               tuple(labels), values))
    return found
