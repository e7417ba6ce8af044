"""Hostile and broken producer rows against real servers: one test per case.

Each test writes normal events around the bad row(s), runs real relays, and checks the same
four things: the other rows flow, no relay exits, the bad row is in the dead-letter table with a
reason that names the problem, and nothing is missing from outbox + dead letter + broker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from devenv import checker
from outbox_relay.runtime.signals import Shutdown
from outbox_relay.tables import Tables
from tests.conftest import Env
from tests.integration.test_pipeline import in_doubt, log_of, outbox_count, stop, wait_until
from tests.integration.test_smoke_pipeline import make_relay

pytestmark = pytest.mark.core  # run on every tested PostgreSQL (CONTRIBUTING.md)

NORMAL = 60  # normal events before and after the bad rows


def insert(env: Env, message_id: str, *, overriding: bool = False, **columns: Any) -> str:
    """One row as a producer (here: a superuser) would write it; returns its message_id."""
    columns = {"message_id": message_id, "exchange": env.exchange, "routing_key": "hostile",
               **columns}
    if "payload" not in columns and "payload_bytes" not in columns:
        columns["payload"] = Jsonb({"hostile": message_id})
    names = sql.SQL(", ").join(sql.Identifier(c) for c in columns)
    values = sql.SQL(", ").join(sql.Placeholder() for _ in columns)
    with env.connect() as conn:
        conn.execute(sql.SQL("INSERT INTO {} ({}) {} VALUES ({})").format(
            Tables(env.table).outbox, names,
            sql.SQL("OVERRIDING SYSTEM VALUE" if overriding else ""), values),
            list(columns.values()))
    return message_id


def normal(env: Env, prefix: str, count: int = NORMAL) -> list[str]:
    with env.connect() as conn:
        return checker.insert_events(conn, env.table, count, exchange=env.exchange,
                                     routing_key=env.routing_key, prefix=prefix)


def dead_letters(env: Env) -> dict[str, str]:
    """{message_id: last_error} of the dead-letter table."""
    with env.connect() as conn:
        rows = conn.execute(sql.SQL("SELECT message_id, last_error FROM {}").format(
            Tables(env.table).dead_letter)).fetchall()
    return {message_id: error for message_id, error in rows}


def dead_count(env: Env) -> int:
    with env.connect() as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(
            Tables(env.table).dead_letter)).fetchone()
    return int(row[0]) if row else 0


def settle(env: Env, relays: Sequence[Any], hostile: dict[str, str], produced: list[str], *,
           max_duplicates: int = 0, timeout: float = 90) -> checker.Report:
    """Wait until the outbox is empty and nothing is in doubt; then the four checks.

    ``hostile``: {message_id: a piece of the reason its dead letter must carry}.
    """
    wait_until(lambda: outbox_count(env) == 0 and not in_doubt(env), timeout,
               "the outbox to empty")
    for proc in relays:
        assert proc.poll() is None, f"a relay exited:\n{log_of(proc)}"
    for proc in relays:
        assert stop(proc) == 0, log_of(proc)
    dead = dead_letters(env)
    assert set(dead) == set(hostile), dead
    for message_id, reason in hostile.items():
        assert reason in dead[message_id], (message_id, dead[message_id])
    report = env.drain_and_check(produced)
    assert report.ok(max_duplicates=max_duplicates, dead_letter_expected=set(hostile)), \
        report.summary()
    return report


def relay(env: Env, **extra: str) -> Any:
    values = {"OUTBOX_BATCH_SIZE": "20", "OUTBOX_MAX_ATTEMPTS": "3", **extra}
    return env.spawn("relay", **values)


# -- headers ---------------------------------------------------------------------------------


def nested_json(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


@pytest.mark.parametrize("where", ["first_batch", "batch_claimed_ahead"])
def test_headers_nested_thousands_of_levels_deep(env: Env, where: str) -> None:
    # jsonb takes nesting Python's json.loads cannot (RecursionError): before the fix it was
    # raised inside the claim's fetch, after PREPARE when in the batch claimed ahead.
    head = normal(env, "head", 5 if where == "first_batch" else 30)
    with env.connect() as conn:
        conn.execute(sql.SQL("INSERT INTO {} (message_id, exchange, routing_key, payload, headers)"
                             " VALUES ('nested', %s, 'k', '{{}}', %s::jsonb)").format(
            Tables(env.table).outbox), (env.exchange, nested_json(10_000)))
    tail = normal(env, "tail")
    settle(env, [relay(env)], {"nested": "nested"}, head + tail)


def test_headers_of_ten_mib_are_refused_from_their_text(env: Env) -> None:
    # Issue 32: a 10 MiB JSON array of zeros (valid jsonb, under OUTBOX_MAX_MESSAGE_BYTES)
    # took a relay from 43 MB to 835 MB while it was decoded. Now measured, never decoded.
    head = normal(env, "head")
    zeros = "(SELECT jsonb_agg(0) FROM generate_series(1, 10 * 1048576 / 3))"
    with env.connect() as conn:
        for message_id, headers in (("array", zeros),
                                    ("table", f"jsonb_build_object('a', {zeros})")):
            conn.execute(sql.SQL("INSERT INTO {} (message_id, exchange, routing_key, payload,"
                                 " headers) VALUES (%s, %s, 'k', '{{}}', " + headers + ")").format(
                Tables(env.table).outbox), (message_id, env.exchange))
    tail = normal(env, "tail")
    settle(env, [relay(env, OUTBOX_MAX_MESSAGE_BYTES=str(16 << 20))],
           {"array": "headers must be a JSON object, got list",
            "table": "headers make a header frame of at least"}, head + tail)


def test_headers_larger_than_frame_max(env: Env) -> None:
    # RabbitMQ closes the whole connection (FRAME_ERROR) on a header frame over frame_max.
    head = normal(env, "head")
    insert(env, "big-headers", headers=Jsonb({"big": "x" * 300_000}))
    tail = normal(env, "tail")
    proc = relay(env)
    settle(env, [proc], {"big-headers": "frame_max of 131072"}, head + tail)
    assert "rabbitmq connection lost" not in log_of(proc)


@pytest.mark.parametrize(("headers", "reason"), [
    (["not", "an", "object"], "headers must be a JSON object"),
    ({"k" * 300: 1}, "cannot be encoded as an AMQP table"),
    ({"n": 2**70}, "cannot be encoded as an AMQP table"),
    ({"f": 1e300}, "cannot be encoded as an AMQP table"),
])
def test_headers_that_are_no_amqp_table(env: Env, headers: Any, reason: str) -> None:
    head = normal(env, "head")
    insert(env, "bad-headers", headers=Jsonb(headers))
    tail = normal(env, "tail")
    settle(env, [relay(env)], {"bad-headers": reason}, head + tail)


@pytest.mark.parametrize("ordering_key", [None, "forged-key"])
def test_headers_that_set_the_relays_order_headers(env: Env, ordering_key: str | None) -> None:
    # Keyless, it was published with the producer's values: a position of its choosing for a key
    # of the normal rows (k1), which an inbox's per-key check then trusted (issue 32). Keyed, the
    # relay overwrote them; its key is one of its own (a keyed dead letter holds its key back).
    head = normal(env, "head")
    insert(env, "forged-order", ordering_key=ordering_key,
           headers=Jsonb({"x-ordering-key": "k1", "x-outbox-id": 2**63 - 1}))
    insert(env, "forged-position", headers=Jsonb({"tenant": "a", "x-outbox-id": 1}))
    tail = normal(env, "tail")
    settle(env, [relay(env)], {
        "forged-order": "header x-ordering-key is set by the relay (from ordering_key and the "
                        "row's id); a row may not set it",
        "forged-position": "header x-outbox-id is set by the relay"}, head + tail)


# -- created_at ------------------------------------------------------------------------------


@pytest.mark.parametrize("created_at", [
    "infinity", "-infinity", "4713-01-01 00:00:00+00 BC", "10000-01-01 00:00:00+00",
    "1969-12-31 23:59:59+00"])
def test_created_at_that_cannot_be_an_amqp_timestamp(env: Env, created_at: str) -> None:
    # psycopg cannot load 'infinity', BC or year-10000 timestamps: the claim failed and the
    # relay claimed the same lowest ids forever; the lag query broke on them too. The row waits
    # a moment first (available_at) so the stats query runs with it in the table.
    head = normal(env, "head")
    with env.connect() as conn:
        conn.execute(sql.SQL(
            "INSERT INTO {} (message_id, exchange, routing_key, payload, created_at, available_at)"
            " VALUES ('bad-time', %s, 'k', '{{}}', %s::timestamptz, now() + interval '1.5 s')"
        ).format(Tables(env.table).outbox), (env.exchange, created_at))
    tail = normal(env, "tail")
    proc = relay(env, OUTBOX_STATS_INTERVAL="0.05", OUTBOX_LOG_LEVEL="DEBUG")
    settle(env, [proc], {"bad-time": "cannot be an AMQP timestamp"}, head + tail)
    log = log_of(proc)
    assert "database_error" not in log and "database error" not in log, log
    with env.connect() as conn:  # the dead letter keeps the value exactly
        kept = conn.execute(sql.SQL("SELECT created_at = %s::timestamptz FROM {}").format(
            Tables(env.table).dead_letter), (created_at,)).fetchone()
    assert kept == (True,)


# -- size and short strings --------------------------------------------------------------------


def test_payload_over_the_message_size_limit(env: Env) -> None:
    head = normal(env, "head")
    insert(env, "too-big-bytes", payload_bytes=b"\x00" * (1 << 20) + b"!")
    insert(env, "too-big-json", payload=Jsonb({"pad": "y" * (1 << 20)}))
    tail = normal(env, "tail")
    settle(env, [relay(env, OUTBOX_MAX_MESSAGE_BYTES=str(1 << 20))],
           {"too-big-bytes": "exceeds OUTBOX_MAX_MESSAGE_BYTES=1048576",
            "too-big-json": "exceeds OUTBOX_MAX_MESSAGE_BYTES=1048576"}, head + tail)
    # Over 1 MiB, fetched, then moved by PostgreSQL after the claim rolled back (no copy
    # sent back from the relay: relay/worker.py, DEAD_LETTER_COPY_MAX): stored whole.
    with env.connect() as conn:
        sizes = dict(conn.execute(sql.SQL(
            "SELECT message_id, coalesce(octet_length(payload_bytes), octet_length(payload::text))"
            " FROM {}").format(Tables(env.table).dead_letter)).fetchall())
    assert sizes == {"too-big-bytes": (1 << 20) + 1, "too-big-json": (1 << 20) + len('{"pad": ""}')}


@pytest.mark.parametrize("column", ["exchange", "routing_key", "message_id", "content_type",
                                    "message_type", "correlation_id"])
def test_short_string_columns_megabytes_long(env: Env, column: str) -> None:
    head = normal(env, "head")
    message_id = "long-column"
    columns: dict[str, Any] = {column: "z" * 2_000_000}
    if column == "message_id":  # its unique index takes no more than a few kB
        message_id = "z" * 2_000
        del columns[column]
    insert(env, message_id, **columns)
    tail = normal(env, "tail")
    settle(env, [relay(env)], {message_id: f"{column} is longer than 255 bytes"}, head + tail)


def test_type_and_correlation_id_with_control_characters(env: Env) -> None:
    # Consumers route, match and log by them: a line break or an escape sequence there is a
    # producer's bug or an attack on those logs, never published.
    head = normal(env, "head")
    insert(env, "crlf-type", message_type="order.paid\r\nX-Injected: 1")
    insert(env, "escape-correlation", correlation_id="\x1b[2Jreq-1")
    insert(env, "c1-correlation", correlation_id="req\u0085")
    tail = normal(env, "tail")
    settle(env, [relay(env)], {
        "crlf-type": "message_type holds the control character U+000D at position 10",
        "escape-correlation": "correlation_id holds the control character U+001B at position 0",
        "c1-correlation": "correlation_id holds the control character U+0085 at position 3",
    }, head + tail)


# -- rows aimed at the ledger ----------------------------------------------------------------


@pytest.mark.parametrize("via", ["default_exchange", "ledger_exchange"])
def test_rows_addressed_to_the_ledger(env: Env, via: str) -> None:
    head = normal(env, "head")
    if via == "default_exchange":
        insert(env, "to-ledger", exchange="", routing_key=env.ledger_stream,
               payload=Jsonb({"type": "batch", "gid": f"{env.gid_prefix}:00000001:1"}))
    else:
        insert(env, "to-ledger", exchange=env.ledger_stream, routing_key=env.ledger_stream,
               payload=Jsonb({"type": "batch", "gid": f"{env.gid_prefix}:00000001:1"}))
    tail = normal(env, "tail")
    settle(env, [relay(env)], {"to-ledger": "addressed to the ledger stream"}, head + tail)
    # Nothing but the relays' own signed records reached the stream.
    conn, channel = env.amqp_channel()
    try:
        channel.basic_qos(prefetch_count=100)
        bodies = []
        for method, _props, body in channel.consume(
                env.ledger_stream, arguments={"x-stream-offset": "first"}, inactivity_timeout=1):
            if method is None:
                break
            bodies.append(body)
        assert bodies and all(b'"mac"' in body for body in bodies)
    finally:
        conn.close()


# -- the relay's own columns, written by a producer -------------------------------------------


def test_producer_written_attempts_and_ids(env: Env) -> None:
    head = normal(env, "head")
    insert(env, "negative-attempts", attempts=-5)
    insert(env, "max-attempts-unroutable", exchange="", routing_key="no.such.queue",
           attempts=2_147_483_647)
    tail = normal(env, "tail")
    produced = [*head, "negative-attempts", *tail]
    settle(env, [relay(env)], {"max-attempts-unroutable": "unroutable"}, produced)


# -- nothing deleted without being published or stored -----------------------------------------


def test_dead_letter_id_collisions_never_drop_a_row(env: Env) -> None:
    tables = Tables(env.table)
    # A first life: rows 1 and 2 are dead-lettered (one invalid, one out of attempts).
    insert(env, "first-invalid", headers=Jsonb([1]))
    insert(env, "first-unroutable", exchange="", routing_key="no.such.queue")
    proc = relay(env, OUTBOX_MAX_ATTEMPTS="1")
    wait_until(lambda: dead_count(env) == 2, 60, "the first dead letters")
    assert stop(proc) == 0
    # The outbox starts again from id 1 (TRUNCATE ... RESTART IDENTITY; a re-created table),
    # and a producer picks an id of its own (OVERRIDING SYSTEM VALUE).
    with env.connect() as conn:
        conn.execute(sql.SQL("TRUNCATE {} RESTART IDENTITY").format(tables.outbox))
    insert(env, "second-invalid", headers=Jsonb([2]))  # id 1 again
    insert(env, "second-unroutable", exchange="", routing_key="no.such.queue")  # id 2 again
    insert(env, "third-invalid", overriding=True, id=1_000, headers=Jsonb([3]))
    head = normal(env, "head")
    settle(env, [relay(env, OUTBOX_MAX_ATTEMPTS="1")], {
        "first-invalid": "JSON object", "first-unroutable": "unroutable",
        "second-invalid": "JSON object", "second-unroutable": "unroutable",
        "third-invalid": "JSON object"}, head)
    with env.connect() as conn:
        ids = conn.execute(sql.SQL("SELECT message_id, outbox_id FROM {}").format(
            tables.dead_letter)).fetchall()
    assert sorted(outbox_id for _m, outbox_id in ids) == [1, 1, 2, 2, 1_000]


# -- a row no check foresees: the broker closes the connection on it ---------------------------


@pytest.fixture
def no_frame_check(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The relay believes frame_max is huge: its header-frame check lets anything through, like
    a poison row of a kind nobody foresaw."""
    from outbox_relay.relay.publisher import AmqpPublisher

    monkeypatch.setattr(AmqpPublisher, "frame_max", property(lambda _self: 1 << 40))
    yield


def test_unknown_poison_row_that_kills_the_connection(env: Env, no_frame_check: None) -> None:
    head = normal(env, "head")
    insert(env, "poison", headers=Jsonb({"big": "x" * 300_000}))
    tail = normal(env, "tail")
    relay_ = make_relay(env, batch_size=20, max_attempts=3, retry_base_delay=0.01,
                        retry_max_delay=0.05, reconnect_max_delay=0.2)
    shutdown = Shutdown()
    relay_.shutdown = shutdown
    errors: list[BaseException] = []

    def run() -> None:
        try:
            relay_.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: outbox_count(env) == 0 and not in_doubt(env), 120,
                   "the outbox to empty")
        assert thread.is_alive() and not errors, errors
    finally:
        shutdown.request()
        thread.join(30)
    dead = dead_letters(env)
    assert set(dead) == {"poison"}
    assert "connection closed by the broker" in dead["poison"] or "in a row" in dead["poison"]
    # Its neighbours were delivered, and not again and again: at most one batch per failure.
    report = env.drain_and_check(head + tail)
    assert report.ok(max_duplicates=3 * 20, dead_letter_expected=1), report.summary()


# -- the stats query --------------------------------------------------------------------------


def test_lag_metric_survives_every_created_at(env: Env) -> None:
    with env.connect() as conn:
        for n, value in enumerate(["infinity", "-infinity", "4713-01-01 BC", "10000-01-01"]):
            conn.execute(sql.SQL(
                "INSERT INTO {} (message_id, routing_key, payload, created_at, available_at)"
                " VALUES (%s, 'k', '{{}}', %s::timestamptz, '-infinity')").format(
                Tables(env.table).outbox), (f"t{n}", value))
    relay_ = make_relay(env)
    relay_.ensure_connected()  # no batch is run: the rows stay
    try:
        session = relay_.store.stats_session()
        session.connect()
        stats = session.stats(0)
        session.close()
    finally:
        relay_.close()
    backlog, lag = stats.backlog, stats.lag
    assert backlog == 4
    assert lag > 60 * 365 * 24 * 3600  # 4713 BC is old; 'infinity' and the future are ignored


def test_hostile_rows_do_not_slow_the_claim_loop_down(env: Env) -> None:
    """Many bad rows at once: each dead-lettered in its own claim transaction, no retry loop."""
    with env.connect() as conn:
        conn.execute(sql.SQL(
            "INSERT INTO {} (message_id, exchange, routing_key, payload, headers)"
            " SELECT 'bad-' || n, %s, 'k', '{{}}', '[1]' FROM generate_series(1, 500) n").format(
            Tables(env.table).outbox), (env.exchange,))
    produced = normal(env, "tail", 500)
    started = time.monotonic()
    proc = relay(env, OUTBOX_BATCH_SIZE="200")
    wait_until(lambda: outbox_count(env) == 0, 60, "the outbox to empty")
    assert time.monotonic() - started < 60
    assert stop(proc) == 0
    assert dead_count(env) == 500
    report = env.drain_and_check(produced)
    assert report.ok(dead_letter_expected=500), report.summary()

