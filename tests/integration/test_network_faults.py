"""The network between the relay and its servers fails: cut, black-holed, refused.

The relay runs as a real process whose PostgreSQL and RabbitMQ URLs point through loopback
proxies (tests/fix_proxy.py); the servers themselves stay up. Each scenario ends with the
total-queue checker after a ``resolver --once`` run: nothing lost, nothing unexpected, nothing
left in the outbox or in doubt, and duplicates bounded by the batches in flight at the faults.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import subprocess
import sys
import time
from datetime import datetime

import pika
import pika.exceptions

from devenv import checker
from devenv.proxy import Proxy
from outbox_relay import rabbitmq
from tests.conftest import ROOT, Env
from tests.fix_proxy import ProxyFactory
from tests.integration.test_pipeline import in_doubt, log_of, outbox_count, stop, wait_until

BATCH = 50
EVENTS = 4000
CONFIRM_TIMEOUT = 2.0


def produce(env: Env, count: int = EVENTS) -> list[str]:
    with env.connect() as conn:
        return checker.insert_events(conn, env.table, count, exchange=env.exchange,
                                     routing_key=env.routing_key)


def spawn_relay(env: Env, pg: Proxy, mq: Proxy, **extra: str) -> subprocess.Popen[bytes]:
    settings = {
        "OUTBOX_DATABASE_URL": pg.url(env.db_url), "OUTBOX_AMQP_URL": mq.url(env.amqp_url),
        "OUTBOX_BATCH_SIZE": str(BATCH), "OUTBOX_POLL_MIN_INTERVAL": "0.02",
        "OUTBOX_CONFIRM_TIMEOUT": str(CONFIRM_TIMEOUT), "OUTBOX_CONNECT_TIMEOUT": "2",
        "OUTBOX_RECONNECT_MAX_DELAY": "1", "OUTBOX_LOG_LEVEL": "DEBUG",
    }
    settings.update(extra)
    return env.spawn("relay", **settings)


def resolve_once(env: Env) -> str:
    """One resolver pass straight at the servers; returns its log."""
    result = subprocess.run([sys.executable, "-m", "outbox_relay.resolver", "--once"], env=env.cli_env(),
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return result.stderr


def progress_below(env: Env, count: int) -> None:
    wait_until(lambda: outbox_count(env) < count, 30, f"the outbox to fall below {count}")


def finish(env: Env, relay: subprocess.Popen[bytes], produced: list[str], *,
           max_duplicates: int, drain_timeout: float = 30) -> checker.Report:
    """Wait for the outbox to empty, stop the relay, resolve, drain, check."""
    try:
        wait_until(lambda: outbox_count(env) == 0 or relay.poll() is not None, drain_timeout,
                   "the outbox to empty")
    except AssertionError as exc:
        tail = "\n".join(log_of(relay).splitlines()[-40:])
        raise AssertionError(f"{exc}; {outbox_count(env)} rows left; the relay's log ends:\n"
                             f"{tail}") from None
    assert relay.poll() is None, log_of(relay)  # a network fault never ends the relay
    # The relay finishes a batch it decided but could not finish; give it a moment.
    wait_until(lambda: not in_doubt(env), 5, "the relay's own in-doubt batch to be finished")
    assert stop(relay) == 0, log_of(relay)
    resolve_once(env)
    report = env.drain_and_check(produced, idle_timeout=1)
    assert report.ok(max_duplicates=max_duplicates), report.summary() + "\n" + log_of(relay)
    return report


def prepared_ages(env: Env) -> dict[str, float]:
    with env.connect() as conn:
        rows = conn.execute(
            "SELECT gid, extract(epoch FROM now() - prepared)::float8 FROM pg_prepared_xacts "
            "WHERE starts_with(gid, %s)", (env.gid_prefix + ":",)).fetchall()
    return {gid: age for gid, age in rows}


def ledger_gids(env: Env) -> set[str]:
    """Every batch gid in the test's ledger stream (read from its first record until idle)."""
    conn = pika.BlockingConnection(pika.URLParameters(env.amqp_url))
    gids: set[str] = set()
    try:
        channel = conn.channel()
        channel.basic_qos(prefetch_count=1000)
        for method, _props, body in channel.consume(
                env.ledger_stream, arguments={"x-stream-offset": "first"}, inactivity_timeout=2):
            if method is None:
                break
            record = json.loads(body)
            if record.get("type") == "batch":
                gids.add(record["gid"])
            channel.basic_ack(method.delivery_tag)
    finally:
        with contextlib.suppress(pika.exceptions.AMQPError, *rabbitmq.CONNECTION_ERRORS):
            conn.close()  # a stream may answer the cancel's reject by closing the connection
    return gids


_GID_RE = r"gid=(\S+?)[,\]\s]"


def gids_logged(text: str, message: str) -> set[str]:
    return {m.group(1) for line in text.splitlines() if message in line
            for m in [re.search(_GID_RE, line)] if m}


# -- RabbitMQ -----------------------------------------------------------------------------------


def test_amqp_connection_cut_mid_stream(env: Env, proxies: ProxyFactory) -> None:
    pg, mq = proxies(env.db_url), proxies(env.amqp_url)
    produced = produce(env)
    relay = spawn_relay(env, pg, mq)
    progress_below(env, EVENTS - 500)
    mq.cut()
    report = finish(env, relay, produced, max_duplicates=BATCH)
    log = log_of(relay)
    assert log.count("rabbitmq connection lost") == 1, log
    assert log.count("rabbitmq reconnected") == 1, log
    assert report.duplicates <= BATCH


def _watch_black_hole(env: Env, seconds: float) -> tuple[dict[str, float], list[tuple[float, int]]]:
    """Poll the prepared transactions (their oldest age) and the outbox size for ``seconds``."""
    started = time.monotonic()
    oldest: dict[str, float] = {}
    counts: list[tuple[float, int]] = []
    while time.monotonic() - started < seconds:
        for gid, age in prepared_ages(env).items():
            oldest[gid] = max(oldest.get(gid, 0.0), age)
        counts.append((time.monotonic() - started, outbox_count(env)))
        time.sleep(0.1)
    return oldest, counts


def _black_hole_mid_stream(
    env: Env, proxies: ProxyFactory, seconds: float
) -> tuple[list[str], subprocess.Popen[bytes], Proxy, dict[str, float], list[tuple[float, int]]]:
    """Start a relay, black-hole its broker once it has made progress, watch for ``seconds``;
    the relay must still be running."""
    pg, mq = proxies(env.db_url), proxies(env.amqp_url)
    produced = produce(env)
    relay = spawn_relay(env, pg, mq)
    progress_below(env, EVENTS - 500)
    mq.blackhole()
    oldest, counts = _watch_black_hole(env, seconds)
    assert relay.poll() is None, log_of(relay)
    return produced, relay, mq, oldest, counts


def _heal_and_time_recovery(env: Env, mq: Proxy, rows_before: int) -> float:
    mq.heal()
    healed = time.monotonic()
    wait_until(lambda: outbox_count(env) < rows_before or outbox_count(env) == 0, 15,
               "the relay to move rows again after heal()")
    return time.monotonic() - healed


def test_amqp_black_hole_mid_stream(env: Env, proxies: ProxyFactory) -> None:
    """No COMMIT PREPARED without confirms while the broker is black-holed; recovery after."""
    # heal() drops the black-holed connections, so anything the relay wrote into the hole
    # never reaches the broker: a batch committed without its confirms would be lost.
    produced, relay, mq, _oldest, counts = _black_hole_mid_stream(env, proxies,
                                                                  CONFIRM_TIMEOUT + 4)
    # Rows leave the outbox during the black hole only by a commit (or by the forget-delivered
    # step, which needs confirms): once the batch in flight is settled, nothing may move.
    settled = [n for t, n in counts if t > CONFIRM_TIMEOUT + 1]
    recovery = _heal_and_time_recovery(env, mq, settled[-1])
    report = finish(env, relay, produced, max_duplicates=2 * BATCH)
    assert len(set(settled)) == 1, f"rows left the outbox while black-holed: {counts}"
    assert "no confirm within 2 s" in log_of(relay), log_of(relay)
    assert recovery < 10, f"recovery took {recovery:.1f} s"
    assert report.lost == []


def test_amqp_black_hole_prepared_batch_outlives_confirm_timeout(
    env: Env, proxies: ProxyFactory
) -> None:
    limit = CONFIRM_TIMEOUT + 2.0
    produced, relay, mq, oldest, counts = _black_hole_mid_stream(env, proxies, limit + 3)
    _heal_and_time_recovery(env, mq, counts[-1][1])
    finish(env, relay, produced, max_duplicates=2 * BATCH)
    too_old = {gid: round(age, 2) for gid, age in oldest.items() if age > limit}
    assert not too_old, (
        f"prepared transactions outlived confirm timeout {CONFIRM_TIMEOUT:g} s + 2 s while the "
        f"broker was black-holed: {too_old}")


# -- PostgreSQL ---------------------------------------------------------------------------------


def test_postgres_connection_cut_mid_stream(env: Env, proxies: ProxyFactory) -> None:
    pg, mq = proxies(env.db_url), proxies(env.amqp_url)
    produced = produce(env)
    relay = spawn_relay(env, pg, mq)
    progress_below(env, EVENTS - 500)
    pg.cut()
    # A lost PostgreSQL connection never needs a republish: the in-flight batch is either not
    # prepared (aborted), prepared and unpublished (rolled back), or recorded (committed).
    report = finish(env, relay, produced, max_duplicates=0)
    log = log_of(relay)
    assert log.count("postgresql connection lost") == 1, log
    assert log.count("postgresql reconnected") == 1, log
    assert report.duplicates == 0


def test_postgres_black_hole_mid_stream(env: Env, proxies: ProxyFactory) -> None:
    pg, mq = proxies(env.db_url), proxies(env.amqp_url)
    produced = produce(env)
    relay = spawn_relay(env, pg, mq)
    progress_below(env, EVENTS - 500)
    pg.blackhole()
    time.sleep(3)
    assert relay.poll() is None, log_of(relay)
    stuck = outbox_count(env)
    pg.heal()  # the black-holed sessions are dropped: the relay must notice and reconnect
    healed = time.monotonic()
    wait_until(lambda: outbox_count(env) < stuck or outbox_count(env) == 0, 15,
               "the relay to move rows again after heal()")
    recovery = time.monotonic() - healed
    report = finish(env, relay, produced, max_duplicates=0)
    assert recovery < 10, f"recovery took {recovery:.1f} s"
    assert "postgresql reconnected" in log_of(relay), log_of(relay)
    assert report.duplicates == 0


def test_postgres_cut_between_ledger_and_commit_prepared(env: Env, proxies: ProxyFactory) -> None:
    """Cut PostgreSQL again and again while the broker works: a batch whose ledger record was
    confirmed ends committed (by the relay after reconnecting, or by the resolver), never
    rolled back and republished."""
    pg, mq = proxies(env.db_url), proxies(env.amqp_url)
    produced = produce(env, 6000)
    relay = spawn_relay(env, pg, mq, OUTBOX_RECONNECT_MAX_DELAY="0.3")
    progress_below(env, 5800)
    finishing_cut = 0
    for _ in range(25):
        pg.cut()
        time.sleep(0.35)
        finishing_cut = log_of(relay).count("connection lost finishing")
        if finishing_cut >= 3 or outbox_count(env) < 500:
            break
    report = finish(env, relay, produced, max_duplicates=0)
    log = log_of(relay)
    assert finishing_cut >= 1, "no cut hit the window between ledger record and COMMIT PREPARED"
    recorded = ledger_gids(env)
    rolled_back = gids_logged(log, "batch rolled back")
    assert not recorded & rolled_back, (recorded & rolled_back, log)
    # The gids whose COMMIT PREPARED was cut off are in the ledger and were committed: by the
    # relay after reconnecting ("batch committed"), or before its retry found the transaction
    # gone (batch_finished_elsewhere: the resolver committed it, or the cut COMMIT PREPARED
    # had gone through; a rollback there would show as a batch of duplicates).
    cut_off = set(re.findall(r"connection lost finishing (\S+)", log))
    assert cut_off <= recorded, (cut_off - recorded, log)
    done = gids_logged(log, "batch committed") | gids_logged(log, "batch_finished_elsewhere")
    assert cut_off <= done, (cut_off - done, log)
    assert report.duplicates == 0


# -- backoff ------------------------------------------------------------------------------------


_STAMP_RE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _stamps(text: str, needle: str) -> list[float]:
    out = []
    for line in text.splitlines():
        match = _STAMP_RE.match(line)
        if match and needle in line:
            out.append(datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


def test_reconnect_backoff_grows_while_postgres_is_refused(env: Env, proxies: ProxyFactory) -> None:
    max_delay = 2.0
    pg, mq = proxies(env.db_url), proxies(env.amqp_url)
    produced = produce(env)
    relay = spawn_relay(env, pg, mq, OUTBOX_RECONNECT_MAX_DELAY=str(max_delay))
    progress_below(env, EVENTS - 500)
    pg.refuse()
    pg.cut()
    time.sleep(12)
    assert relay.poll() is None, log_of(relay)
    log = log_of(relay)
    pg.heal()
    # The first failed attempt of the outage is a WARNING of its own, the others DEBUG lines.
    attempts = sorted(_stamps(log, "connecting to postgresql failed")
                      + _stamps(log, "reconnect to postgresql failed"))
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert len(gaps) >= 7, (gaps, log)
    # wait_random_exponential(0.2, max): gap n is uniform in [0, min(max, 0.2 * 2^(n-1))].
    slack = 0.25  # a refused connect, logging, the 50 ms sleep step
    assert all(g <= max_delay + slack for g in gaps), gaps
    first, later = gaps[:3], gaps[5:]
    assert max(first) <= 0.8 + slack, gaps
    assert sum(later) / len(later) > sum(first) / len(first), gaps
    assert max(later) > 0.8, gaps
    finish(env, relay, produced, max_duplicates=BATCH)
