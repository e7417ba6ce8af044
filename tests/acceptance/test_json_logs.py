"""JSON logs of the real programs: one object a line, a stable action on every line of ours, the gid
and the batch size where they apply, and never the password."""

from __future__ import annotations

import signal
from typing import Any

from psycopg import sql
from psycopg.types.json import Jsonb

from devenv import checker
from outbox_relay.tables import Tables
from tests.conftest import Env
from tests.integration.test_pipeline import in_doubt, json_lines, log_of, outbox_count, stop, wait_until

SECRET = "pw-Xq7-never-logged"


def with_password(url: str) -> tuple[str, str]:
    """The URL with a password (the test server trusts any); a URL that has one keeps it."""
    scheme, rest = url.split("://", 1)
    userinfo, host = rest.rsplit("@", 1)
    if ":" in userinfo:
        return url, userinfo.split(":", 1)[1]
    return f"{scheme}://{userinfo}:{SECRET}@{host}", SECRET


def test_json_logs_name_every_event_with_gid_and_batch_size_and_hide_the_password(
        env: Env) -> None:
    db_url, password = with_password(env.db_url)
    assert password
    settings = {"OUTBOX_DATABASE_URL": db_url, "OUTBOX_LOG_FORMAT": "json",
                "OUTBOX_LOG_LEVEL": "DEBUG", "OUTBOX_BATCH_SIZE": "10", "OUTBOX_MAX_ATTEMPTS": "2"}
    outbox = Tables(env.table).outbox
    with env.connect() as conn:
        checker.insert_events(conn, env.table, 40, exchange=env.exchange,
                              routing_key=env.routing_key)
        insert = sql.SQL("INSERT INTO {} (message_id, exchange, routing_key, payload, headers) "
                         "VALUES (%s, %s, 'k', '{{}}', %s)").format(outbox)
        conn.execute(insert, ("bad-headers", env.exchange, Jsonb(["not", "an", "object"])))
        conn.execute(insert, ("no-exchange", f"{env.exchange}.missing", Jsonb({})))

    # A relay that dies after its first batch's ledger record: the resolver commits it.
    crashed = env.spawn("relay", OUTBOX_TEST_CRASH_AT="after_ledger", **settings)
    assert crashed.wait(60) == -signal.SIGKILL, log_of(crashed)
    assert len(in_doubt(env)) == 1
    resolver = env.spawn("resolver", OUTBOX_RESOLVER_INTERVAL="0.2", **settings)
    wait_until(lambda: not in_doubt(env), 30, "the resolver to finish the batch")
    relay = env.spawn("relay", **settings)
    wait_until(lambda: outbox_count(env) == 0, 60, "the outbox to empty")
    assert stop(relay) == 0, log_of(relay)
    assert stop(resolver) == 0, log_of(resolver)

    logs = {name: log_of(proc) for name, proc in
            (("crashed", crashed), ("resolver", resolver), ("relay", relay))}
    for name, text in logs.items():
        assert password not in text, f"the password is in the {name}'s log"
    lines = {name: json_lines(text) for name, text in logs.items()}
    for name, found in lines.items():
        for line in found:
            assert {"time", "level", "logger", "action", "message"} <= set(line), line
            if line["logger"].startswith(("relay", "resolver")):
                assert line["action"], f"{name}: a line of ours without an action: {line}"

    def by_action(name: str, action: str) -> list[dict[str, Any]]:
        return [line for line in lines[name] if line["action"] == action]

    for name in ("resolver", "relay"):
        assert {line["server"] for line in by_action(name, "connected")} == {
            "postgresql", "rabbitmq"}, name
    (decision,) = by_action("resolver", "resolved_committed")
    assert decision["gid"].startswith(env.gid_prefix + ":")
    assert decision["batch_size"] == 10
    committed = by_action("relay", "batch_committed")
    assert committed and all(line["gid"].startswith(env.gid_prefix + ":") and
                             1 <= line["batch_size"] <= 10 for line in committed)
    rolled_back = by_action("relay", "batch_rolled_back")
    assert rolled_back and all(line["gid"] and line["batch_size"] >= 1 and line["reason"]
                               for line in rolled_back)
    failed = by_action("relay", "row_failed")
    dead = {line["message_id"]: line for line in by_action("relay", "row_dead_lettered")}
    assert [line["message_id"] for line in failed] == ["no-exchange"]
    assert set(dead) == {"bad-headers", "no-exchange"}
    assert dead["bad-headers"]["reason"] == "invalid"
    assert dead["no-exchange"]["reason"] == "exhausted"
    for line in (*failed, *dead.values()):
        assert line["gid"].startswith(env.gid_prefix + ":") and line["row_id"] >= 1
        assert line["level"] == "WARNING"
    assert [line["action"] for line in lines["relay"]][-1] == "relay_stopped"
