"""The Grafana dashboard (deploy/grafana/outbox-relay.json), written by ``./dev docs``.

Kept as code so every query gets the same label filter and grouping, and the thresholds are the
alert rules' own levels (deploy/prometheus/alerts.yml; tests/repository/test_deploy_files.py checks
they agree).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# Which outbox: every query keeps these labels apart (the alerts group by namespace and job).
SELECTOR = 'namespace=~"$namespace", job=~"$job", instance=~"$instance"'
BY = "namespace, job"
OURS = (f"(outbox_relay_build_info{{{SELECTOR}}} or outbox_resolver_build_info{{{SELECTOR}}})")

# The alert levels (deploy/prometheus/alerts.yml).
LAG_ALERT = 60
BACKLOG_ALERT = 1000
IN_DOUBT_ALERT = 120
SCAN_ALERT = 120
SESSION_ALERT = 300
EVENT_AGE_ALERT = 60


def m(metric: str) -> str:
    """A metric with the dashboard's label filter."""
    return f"{metric}{{{SELECTOR}}}"


def rate(metric: str) -> str:
    return f"rate({m(metric)}[$__rate_interval])"


@dataclass
class Panel:
    title: str
    description: str
    targets: list[tuple[str, str]]  # (expr, legend)
    unit: str = "short"
    threshold: float | None = None  # an alert's level: a red line on the graph
    below: bool = False  # the threshold is a floor (red under it)
    width: int = 8
    extra: dict[str, Any] = field(default_factory=dict)


def _legend(*labels: str) -> str:
    return " ".join("{{" + label + "}}" for label in labels)


PANELS = [
    Panel("Events published /s",
          "Throughput: events confirmed by the broker in committed batches, per outbox.",
          [(f"sum by ({BY}) ({rate('outbox_relay_events_published_total')})",
            _legend("namespace", "job"))], unit="ops"),
    Panel("Lag (oldest unpublished event)",
          "How late the oldest outbox row not yet published is (its age since it was due: "
          "created_at, or a producer's later available_at), as the relays see it and as the "
          f"resolver does (one query per database). Rising: relays slow, failing or down. The "
          f"red line is OutboxLagHigh's level ({LAG_ALERT} s, for 2 min).",
          [(f"max by ({BY}) ({m('outbox_relay_lag_seconds')})", _legend("namespace", "job")),
           (f"max by ({BY}) ({m('outbox_lag_seconds')})", _legend("namespace", "job") + " (resolver)")],
          unit="s", threshold=LAG_ALERT),
    Panel("Backlog",
          "Rows waiting in the outbox (every relay reports the same table: max, not sum). The "
          f"red line is OutboxBacklogGrowing's level ({BACKLOG_ALERT:,} rows, rising for 10 min).",
          [(f"max by ({BY}) ({m('outbox_relay_backlog_events')})", _legend("namespace", "job")),
           (f"max by ({BY}) ({m('outbox_backlog_events')})", _legend("namespace", "job") + " (resolver)")],
          threshold=BACKLOG_ALERT),
    Panel("Batch duration p50 / p99",
          "Claim to COMMIT/ROLLBACK PREPARED. p99 near OUTBOX_CONFIRM_TIMEOUT: the broker is slow "
          "to confirm (flow control, disk).",
          [(f"histogram_quantile(0.99, sum by ({BY}, le) "
            f"({rate('outbox_relay_batch_duration_seconds_bucket')}))",
            _legend("namespace", "job") + " p99"),
           (f"histogram_quantile(0.5, sum by ({BY}, le) "
            f"({rate('outbox_relay_batch_duration_seconds_bucket')}))",
            _legend("namespace", "job") + " p50")], unit="s"),
    Panel("Batches by outcome /s",
          "committed is the normal case; rolled_back means failures; finished_elsewhere means the "
          "resolver got there first.",
          [(f"sum by ({BY}, outcome) ({rate('outbox_relay_batches_total')})",
            _legend("namespace", "job", "outcome"))], unit="ops"),
    Panel("Failed batches by reason /s",
          "Batches rolled back after a failed publish: row_failures (some rows refused: next "
          "panel), connection_lost / confirm_timeout / ledger (broker or network). The sum is "
          "the failed batches.",
          [(f"sum by ({BY}, reason) ({rate('outbox_relay_batch_failures_total')})",
            _legend("namespace", "job", "reason"))], unit="ops"),
    Panel("Failed rows by reason /s",
          "Rows of failed batches, each of which got an attempt: unroutable / exchange_not_found "
          "(the producers' data or the broker's topology), nacked (a full queue with "
          "reject-publish, or a quorum queue changing leader), channel_closed (unconfirmed "
          "when the broker closed the channel).",
          [(f"sum by ({BY}, reason) ({rate('outbox_relay_row_failures_total')})",
            _legend("namespace", "job", "reason"))], unit="ops"),
    Panel("Dead-lettered (1 h)",
          "Rows moved to <table>_dead_letter: invalid (never publishable) or exhausted (out of "
          "attempts). Any is OutboxDeadLettering's level.",
          [(f"sum by ({BY}, reason) (increase({m('outbox_relay_dead_lettered_total')}[1h]))",
            _legend("namespace", "job", "reason"))], threshold=1),
    Panel("Keys held back by a dead letter",
          "Ordering keys with a dead letter (the resolver's count): none of their later rows is "
          "published until it is requeued or deleted. Any is OutboxKeysBlocked's level (for 5 min).",
          [(f"max by ({BY}) ({m('outbox_blocked_keys')})", _legend("namespace", "job"))],
          threshold=1),
    Panel("Waiting for a standby",
          "1 while a relay publishes nothing because the standby OUTBOX_STANDBY_WAIT names did "
          "not flush its batches in time (after a failover: no standby yet); 0 otherwise. Any "
          "is OutboxWaitingForStandby's level (for 1 min).",
          [(f"max by ({BY}) ({m('outbox_relay_waiting_for_standby')})",
            _legend("namespace", "job"))], threshold=1),
    Panel("Reconnects (1 h)", "Reconnections to postgresql / rabbitmq.",
          [(f"sum by ({BY}, server) (increase({m('outbox_relay_reconnects_total')}[1h]))",
            _legend("namespace", "job", "server"))]),
    Panel("Connected", "1 while every relay is connected to the server; red below.",
          [(f"min by ({BY}, server) ({m('outbox_relay_connected')})",
            _legend("namespace", "job", "server"))], threshold=1, below=True),
    Panel("Prepared transactions", "Our prepared transactions (in flight or in doubt).",
          [(f"max by ({BY}) ({m('outbox_prepared_transactions')})", _legend("namespace", "job"))]),
    Panel("Oldest prepared transaction",
          "Age of our oldest prepared transaction (in flight or in doubt). It holds its rows' "
          "locks and, while no older transaction exists, VACUUM's xmin horizon: it should stay "
          f"near zero. The red line is OutboxPreparedTransactionInDoubt's level ({IN_DOUBT_ALERT} s).",
          [(f"max by ({BY}) ({m('outbox_prepared_oldest_age_seconds')})",
            _legend("namespace", "job"))], unit="s", threshold=IN_DOUBT_ALERT),
    Panel("Resolver decisions (1 h)",
          "committed / rolled_back / already_finished: each is a crashed or stuck relay's batch.",
          [(f"sum by ({BY}, outcome) (increase({m('outbox_resolver_decisions_total')}[1h]))",
            _legend("namespace", "job", "outcome"))]),
    Panel("Relays up",
          "Relays Prometheus scrapes now, by job (fewer than deployed: pods down or not scraped).",
          [(f"count by ({BY}) ({m('outbox_relay_build_info')})", _legend("namespace", "job"))]),
    Panel("Since last resolver scan",
          "Should stay below a few scan intervals. The red line is OutboxResolverNotRunning's "
          f"level ({SCAN_ALERT} s).",
          [(f"time() - max by ({BY}) ({m('outbox_resolver_last_scan_timestamp_seconds')})",
            _legend("namespace", "job"))], unit="s", threshold=SCAN_ALERT),
    Panel("Our batch holding back VACUUM",
          "Age of our oldest prepared transaction while it is the oldest transaction of the "
          "database, so VACUUM cannot remove rows deleted after it; 0 while something else (or "
          "nothing) is older. Above a few seconds: the resolver is not finishing it (see the "
          "in-doubt alert).",
          [(f"max by ({BY}) ({m('outbox_prepared_holding_vacuum_age_seconds')})",
            _legend("namespace", "job"))], unit="s"),
    Panel("Oldest transaction of another session",
          "Age of the oldest open transaction or snapshot of another client session in the "
          "outbox's database. While it lives VACUUM removes no outbox row deleted after it began, "
          "and the table grows by the minute (a claim starts past them, from the relay's "
          "low-water mark; the once-a-second look from its floor reads them). The red line is "
          f"OutboxVacuumHeldBySession's level ({SESSION_ALERT} s).",
          [(f"max by ({BY}) ({m('outbox_session_transaction_age_seconds')})",
            _legend("namespace", "job"))], unit="s", threshold=SESSION_ALERT),
    Panel("Outbox size on disk",
          "The outbox's heap and indexes (the resolver reads them every OUTBOX_STATS_INTERVAL). "
          "They grow while a snapshot holds VACUUM back and keep their size after it; the "
          "resolver compacts them once a hold over OUTBOX_RESOLVER_COMPACT_AFTER_HOLD has "
          "ended (next panel), or `outbox-relay compact` does.",
          [(f"max by ({BY}, part) ({m('outbox_table_bytes')})",
            _legend("namespace", "job", "part"))], unit="bytes"),
    Panel("Resolver compactions (1 h)",
          "What came of each hold that ended: compacted; failed (tried again a minute later); "
          "not_allowed (the resolver's role may not rewrite the table: run outbox-relay compact "
          "as its owner); not_needed (below OUTBOX_RESOLVER_COMPACT_ABOVE).",
          [(f"sum by ({BY}, outcome) "
            f"(increase({m('outbox_resolver_compactions_total')}[1h]))",
            _legend("namespace", "job", "outcome"))]),
    Panel("What holds back VACUUM (xid age)",
          "Age in transactions of the oldest transaction id each kind of holder keeps alive in "
          "this database: our prepared batches, other prepared transactions, sessions (open "
          "transactions, snapshots), replication slots. The highest line is the xmin horizon; if "
          "it is not outbox_prepared, the cause is outside the relay.",
          [(f"max by ({BY}, holder) ({m('outbox_xmin_horizon_age_transactions')})",
            _legend("namespace", "job", "holder"))], width=24),
    Panel("Memory (RSS) per process",
          "Resident memory of each relay and resolver process (process_resident_memory_bytes).",
          [(f"{m('process_resident_memory_bytes')} and on (namespace, job, instance) {OURS}",
            _legend("namespace", "job", "instance"))], unit="bytes"),
    Panel("CPU per process",
          "CPU cores used by each relay and resolver process (process_cpu_seconds_total).",
          [(f"{rate('process_cpu_seconds_total')} and on (namespace, job, instance) {OURS}",
            _legend("namespace", "job", "instance"))], unit="percentunit"),
    # The consumers' side: the inbox's metrics, exported by each consuming service
    # (outbox_relay.inbox_metrics; their job is the service's).
    Panel("Inbox: event age when applied p50 / p99",
          "How old an event was when a consumer's inbox committed it: from the producer's "
          "commit (the AMQP timestamp, the row's created_at, in whole seconds) to the "
          "consumer's, the delay the services' users see; by consumer. The red line is "
          f"OutboxEventAgeHigh's level ({EVENT_AGE_ALERT} s at p99, for 5 min).",
          [(f"histogram_quantile(0.99, sum by ({BY}, consumer, le) "
            f"({rate('outbox_inbox_event_age_seconds_bucket')}))",
            _legend("namespace", "job", "consumer") + " p99"),
           (f"histogram_quantile(0.5, sum by ({BY}, consumer, le) "
            f"({rate('outbox_inbox_event_age_seconds_bucket')}))",
            _legend("namespace", "job", "consumer") + " p50")],
          unit="s", threshold=EVENT_AGE_ALERT),
    Panel("Inbox: messages by outcome /s",
          "What the consumers' inboxes did: applied (the handler ran and committed), duplicate "
          "(a copy, acked), stale (older than the key's last applied event), failed (the "
          "handler or the database raised: requeued or rejected by on_error).",
          [(f"sum by ({BY}, consumer, outcome) ({rate('outbox_inbox_messages_total')})",
            _legend("namespace", "job", "consumer", "outcome"))], unit="ops"),
    Panel("Inbox: handler duration p50 / p99",
          "Each run of a consumer's handler, inside the inbox's transaction.",
          [(f"histogram_quantile(0.99, sum by ({BY}, consumer, le) "
            f"({rate('outbox_inbox_handler_duration_seconds_bucket')}))",
            _legend("namespace", "job", "consumer") + " p99"),
           (f"histogram_quantile(0.5, sum by ({BY}, consumer, le) "
            f"({rate('outbox_inbox_handler_duration_seconds_bucket')}))",
            _legend("namespace", "job", "consumer") + " p50")], unit="s"),
    Panel("Versions running",
          "Processes by version (outbox_relay_build_info, outbox_resolver_build_info): two lines "
          "during a rolling upgrade.",
          [(f"count by (job, version) {OURS}", _legend("job", "version"))]),
]


def _variable(name: str, label: str, matchers: str) -> dict[str, Any]:
    # The consuming services are found by their inbox's metrics.
    names = "outbox_relay_build_info|outbox_resolver_build_info|outbox_inbox_messages_total"
    query = f'label_values({{__name__=~"{names}"{matchers}}}, {name})'
    return {
        "name": name, "label": label, "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query, "refresh": 2, "sort": 1,
        "multi": True, "includeAll": True, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }


def _panel(number: int, panel: Panel, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit}
    if panel.threshold is not None:
        steps = ([{"color": "red", "value": None}, {"color": "green", "value": panel.threshold}]
                 if panel.below else
                 [{"color": "green", "value": None}, {"color": "red", "value": panel.threshold}])
        defaults["thresholds"] = {"mode": "absolute", "steps": steps}
        defaults["custom"] = {"thresholdsStyle": {"mode": "line"}}
    return {
        "id": number, "type": "timeseries", "title": panel.title,
        "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "targets": [{"expr": expr, "refId": chr(ord("A") + i), "legendFormat": legend}
                    for i, (expr, legend) in enumerate(panel.targets)],
        **panel.extra,
    }


def dashboard() -> dict[str, Any]:
    panels = []
    x = y = 0
    for number, panel in enumerate(PANELS, 1):
        if x + panel.width > 24:
            x, y = 0, y + 8
        panels.append(_panel(number, panel, x, y))
        x += panel.width
    return {
        "title": "outbox-relay", "uid": "outbox-relay", "schemaVersion": 38, "version": 2,
        "tags": ["outbox", "rabbitmq", "postgresql"],
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus",
             "label": "Prometheus"},
            _variable("namespace", "Namespace", ""),
            _variable("job", "Job", ', namespace=~"$namespace"'),
            _variable("instance", "Instance", ', namespace=~"$namespace", job=~"$job"'),
        ]},
        "panels": panels,
    }


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"
