"""`outbox-relay dead-letter list|requeue|discard` as a subprocess, against real servers."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from psycopg import sql
from psycopg.types.json import Jsonb

from devenv import checker
from outbox_relay.tables import Tables
from tests.conftest import ROOT, Env
from tests.integration.test_pipeline import outbox_count, wait_until

COLUMNS = ("id", "message_id", "exchange", "routing_key", "ordering_key", "payload", "headers",
           "created_at", "attempts", "last_error")


def run(env: Env, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "outbox_relay.relay", "dead-letter", *args],
                          env=env.cli_env(**extra), cwd=ROOT, capture_output=True, text=True,
                          timeout=30)


def insert_dead_letters(env: Env, count: int, *, start: int = 1) -> list[str]:
    """Dead letters as the relay writes them (their id is the old outbox id); returns message ids."""
    ids = []
    with env.connect() as conn:
        for n in range(start, start + count):
            message_id = f"dl-{n}"
            conn.execute(
                sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
                    Tables(env.table).dead_letter,
                    sql.SQL(", ").join(map(sql.Identifier, COLUMNS)),
                    sql.SQL(", ").join(sql.Placeholder() * len(COLUMNS))),
                (1000 + n, message_id, env.exchange, env.routing_key, f"k{n}",
                 Jsonb({"key": f"k{n}", "seq": n}), Jsonb({"x-try": n}),
                 "2026-01-01T00:00:00Z", 10, f"unroutable: NO_ROUTE\nattempt {n}"))
            ids.append(message_id)
    return ids


def rows(env: Env, table: sql.Identifier, columns: str) -> list[tuple[Any, ...]]:
    with env.connect() as conn:
        return conn.execute(sql.SQL("SELECT " + columns + " FROM {} ORDER BY id").format(table)
                            ).fetchall()


def test_list_prints_one_line_per_dead_letter_or_json(env: Env) -> None:
    insert_dead_letters(env, 3)
    result = run(env, "list")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    fields = lines[0].split("\t")
    assert fields[:5] == ["1001", "dl-1", env.exchange, env.routing_key, "10"]
    assert fields[5].startswith("20")  # dead_at, ISO 8601
    assert fields[6] == "unroutable: NO_ROUTE attempt 1"  # the error on the same line

    limited = run(env, "list", "--limit", "2", "--json")
    assert limited.returncode == 0, limited.stderr
    listed = json.loads(limited.stdout)
    assert [d["id"] for d in listed] == [1001, 1002]
    assert listed[0]["message_id"] == "dl-1" and listed[0]["attempts"] == 10
    assert listed[0]["last_error"] == "unroutable: NO_ROUTE\nattempt 1"
    assert "2 of 3" in limited.stderr


def test_list_escapes_the_control_characters_of_a_producers_text(env: Env) -> None:
    # A message id, routing key or error that holds a newline printed a line of its own (a
    # forged dead letter), a tab shifted the columns, an escape sequence drove the terminal.
    values = {"message_id": "m-1\n1002\tforged\tline", "routing_key": "rk\x1b[2J\u2028",
              "last_error": "unroutable \x1b[31mred\x1b[0m\r\nattempt 1"}
    with env.connect() as conn:
        conn.execute(sql.SQL("INSERT INTO {} (id, message_id, exchange, routing_key, payload, "
                             "headers, created_at, attempts, last_error) "
                             "VALUES (1001, %s, %s, %s, '{{}}', '{{}}', now(), 1, %s)"
                             ).format(Tables(env.table).dead_letter),
                     (values["message_id"], env.exchange, values["routing_key"],
                      values["last_error"]))

    result = run(env, "list")
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    assert all(char.isprintable() or char == "\t" for char in line)
    fields = line.split("\t")
    assert len(fields) == 7
    assert fields[1] == "m-1\\n1002\\tforged\\tline"
    assert fields[3] == "rk\\x1b[2J\\u2028"
    assert fields[6] == "unroutable \\x1b[31mred\\x1b[0m attempt 1"

    listed = run(env, "list", "--json")  # JSON escapes them itself, and keeps them exactly
    assert listed.returncode == 0, listed.stderr
    assert all(char.isprintable() or char == "\n" for char in listed.stdout)
    (dead,) = json.loads(listed.stdout)
    assert {k: dead[k] for k in values} == values


def test_requeue_by_id_and_all_moves_rows_back_and_the_relay_delivers_them(env: Env) -> None:
    insert_dead_letters(env, 4)
    tables = Tables(env.table)

    result = run(env, "requeue", "--id", "1002", "--id", "1004", "--id", "99")
    assert result.returncode == 0, result.stderr
    assert "requeued 2 dead letters" in result.stdout
    assert "skipped dead letter 99: not in" in result.stdout
    assert [r[0] for r in rows(env, tables.dead_letter, "id")] == [1001, 1003]
    outbox = rows(env, tables.outbox, "id, message_id, attempts, last_error, available_at <= now(), "
                                      "ordering_key, payload, headers, created_at")
    assert [r[1:6] for r in outbox] == [("dl-2", 0, None, True, "k2"), ("dl-4", 0, None, True, "k4")]
    assert outbox[0][6] == {"key": "k2", "seq": 2} and outbox[0][7] == {"x-try": 2}
    assert outbox[0][8].year == 2026 and outbox[0][8].month == 1  # created_at kept
    assert all(r[0] not in (1002, 1004) for r in outbox)  # new identity ids

    # dl-1 is also in the outbox already (a producer re-sent it): that row stays dead.
    with env.connect() as conn:
        checker.insert_events(conn, env.table, 1, exchange=env.exchange,
                              routing_key=env.routing_key, prefix="dl", start=1)
    result = run(env, "requeue", "--all")
    assert result.returncode == 0, result.stderr
    assert "skipped dead letter 1001: message_id 'dl-1' is already in the outbox" in result.stdout
    assert "requeued 1 dead letter " in result.stdout
    assert [r[0] for r in rows(env, tables.dead_letter, "message_id")] == ["dl-1"]
    assert sorted(r[0] for r in rows(env, tables.outbox, "message_id")) == [
        "dl-1", "dl-2", "dl-3", "dl-4"]

    # The re-sent dl-1 has the key of a dead letter (k1): per-key order holds it back until
    # the operator deals with that dead letter; the others go out.
    relay = env.spawn("relay")
    wait_until(lambda: outbox_count(env) == 1, 30, "every row but dl-1 to go")
    delivered = checker.drain(env.amqp_url, env.queue, expected={"dl-2", "dl-3", "dl-4"})
    assert sorted(d.message_id for d in delivered) == ["dl-2", "dl-3", "dl-4"]
    discarded = run(env, "discard", "--all", "--yes")
    assert discarded.returncode == 0, discarded.stderr
    assert discarded.stdout.splitlines()[-1] == (
        f"discarded 1 dead letter from {env.table}_dead_letter")
    wait_until(lambda: outbox_count(env) == 0, 30, "dl-1 to go once its key is free")
    assert [d.message_id for d in checker.drain(env.amqp_url, env.queue, expected={"dl-1"})] == [
        "dl-1"]
    relay.send_signal(signal.SIGTERM)
    assert relay.wait(20) == 0, Path(relay.log_path).read_text()  # type: ignore[attr-defined]


def test_requeue_needs_ids_or_all_and_a_migrated_table(env: Env) -> None:
    assert run(env, "requeue").returncode == 2
    both = run(env, "requeue", "--id", "1", "--all")
    assert both.returncode == 2 and "not allowed with" in both.stderr
    missing = run(env, "list", OUTBOX_TABLE="never_migrated")
    assert missing.returncode == 3
    assert missing.stderr.strip().splitlines() == [
        "outbox-relay: error: table 'never_migrated' or 'never_migrated_dead_letter' does not "
        "exist: run `outbox-relay migrate` first"]
    unreachable = run(env, "list", OUTBOX_DATABASE_URL="postgresql://app:pw@127.0.0.1:9/x",
                      OUTBOX_CONNECT_TIMEOUT="1")
    assert unreachable.returncode == 1 and "cannot connect to PostgreSQL" in unreachable.stderr


def test_help_lists_the_dead_letter_options() -> None:
    for sub in ("list", "requeue"):
        help_text = subprocess.run(
            [sys.executable, "-m", "outbox_relay.relay", "dead-letter", sub, "--help"],
            env={"PYTHONPATH": str(ROOT)}, cwd=ROOT, capture_output=True, text=True,
            timeout=30).stdout
        for env_var in ("OUTBOX_DATABASE_URL", "OUTBOX_TABLE", "OUTBOX_CONNECT_TIMEOUT"):
            assert env_var in help_text, (sub, help_text)



def dead_ids(env: Env) -> list[int]:
    return [r[0] for r in rows(env, Tables(env.table).dead_letter, "id")]


def varied_dead_letters(env: Env) -> None:
    """1001-1006: two exchanges, two reasons, three of them dead-lettered 10 days ago."""
    insert_dead_letters(env, 6)
    with env.connect() as conn:
        conn.execute(sql.SQL(
            "UPDATE {} SET exchange = %s || '.other', last_error = 'Exchange Not Found: x',"
            " dead_at = now() - interval '10 days' WHERE id IN (1004, 1005, 1006)").format(
            Tables(env.table).dead_letter), (env.exchange,))
        conn.execute(sql.SQL("UPDATE {} SET dead_at = now() - interval '10 days' WHERE id = 1001"
                             ).format(Tables(env.table).dead_letter))


def listed_ids(result: subprocess.CompletedProcess[str]) -> list[int]:
    assert result.returncode == 0, result.stderr
    return [int(line.split("\t")[0]) for line in result.stdout.splitlines()]


def test_list_filters_by_exchange_reason_and_age(env: Env) -> None:
    varied_dead_letters(env)
    other = env.exchange + ".other"
    assert listed_ids(run(env, "list", "--exchange", other)) == [1004, 1005, 1006]
    assert listed_ids(run(env, "list", "--reason", "no_route")) == [1001, 1002, 1003]
    assert listed_ids(run(env, "list", "--older-than", "7D")) == [1001, 1004, 1005, 1006]
    assert listed_ids(run(env, "list", "--newer-than", "1h")) == [1002, 1003]
    assert listed_ids(run(env, "list", "--older-than", "7D", "--reason", "NO_ROUTE")) == [1001]
    assert listed_ids(run(env, "list", "--exchange", "nowhere")) == []
    limited = run(env, "list", "--exchange", other, "--limit", "1", "--json")
    assert [d["id"] for d in json.loads(limited.stdout)] == [1004]
    assert "1 of 3 dead letters shown" in limited.stderr
    bad = run(env, "list", "--older-than", "7 days")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].endswith(
        "argument --older-than: must be a positive age such as 7D, 36h, 90m or 3600s "
        "(got '7 days')")


def test_discard_shows_asks_and_deletes_exactly_what_it_showed(env: Env) -> None:
    varied_dead_letters(env)
    # Nothing named, or --all with a filter: refused before connecting.
    for args in ((), ("--all", "--reason", "x")):
        refused = run(env, "discard", *args)
        assert refused.returncode == 2
        assert refused.stderr.strip().splitlines() == [
            "outbox-relay: error: name the dead letters to discard: --id, a filter (--exchange, "
            "--reason, --older-than, --newer-than) or --all, and --all alone"]

    # No terminal to ask on and no --yes: it shows them, and deletes nothing.
    shown = run(env, "discard", "--reason", "exchange not found", "--older-than", "7D")
    assert shown.returncode == 2
    assert listed_ids(subprocess.CompletedProcess([], 0, shown.stdout, "")) == [1004, 1005, 1006]
    assert shown.stderr.strip().splitlines() == [
        "outbox-relay: error: would discard 3 dead letters: nothing discarded; confirm with "
        "--yes (--dry-run only prints them)"]
    dry = run(env, "discard", "--exchange", env.exchange + ".other", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[-1] == (f"would discard 3 dead letters from {env.table}_dead_"
                                           "letter (--dry-run: nothing discarded)")
    assert dead_ids(env) == [1001, 1002, 1003, 1004, 1005, 1006]

    done = run(env, "discard", "--exchange", env.exchange + ".other", "--yes")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"discarded 3 dead letters from {env.table}_dead_letter"
    assert dead_ids(env) == [1001, 1002, 1003]

    # By id, with one that is not there; the filters narrow the ids.
    done = run(env, "discard", "--id", "1002", "--id", "99", "--yes")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"skipped dead letter 99: not in {env.table}_dead_letter"
    assert dead_ids(env) == [1001, 1003]
    done = run(env, "discard", "--id", "1001", "--id", "1003", "--newer-than", "1D", "--yes")
    assert done.returncode == 0, done.stderr
    assert dead_ids(env) == [1001]
    nothing = run(env, "discard", "--reason", "no such reason", "--yes")
    assert nothing.returncode == 0 and "no dead letter matches" in nothing.stdout


def on_a_terminal(env: Env, answer: str, *args: str,
                  before_answer: Any = None) -> tuple[int, str]:
    """`dead-letter discard ARGS` with a terminal as its stdin: wait for the question, run
    ``before_answer``, type ``answer``; (exit code, everything it wrote to the terminal)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "outbox_relay.relay", "dead-letter", "discard",
                             *args], env=env.cli_env(), cwd=ROOT, stdin=follower,
                            stdout=follower, stderr=follower)
    os.close(follower)
    seen = b""
    try:
        deadline = time.monotonic() + 30
        while b"[y/N]" not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, seen
            if select.select([leader], [], [], 0.2)[0]:
                seen += os.read(leader, 4096)
        if before_answer is not None:
            before_answer()
        os.write(leader, answer.encode() + b"\n")
        code = proc.wait(30)
        while select.select([leader], [], [], 0.2)[0]:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closed with the process
                break
            if not chunk:
                break
            seen += chunk
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    return code, seen.decode(errors="replace")


def test_discard_asks_on_a_terminal_and_deletes_only_what_it_showed(env: Env) -> None:
    insert_dead_letters(env, 2)
    code, screen = on_a_terminal(env, "n", "--reason", "no_route")
    assert code == 1 and "discard these 2 dead letters from" in screen
    assert "nothing discarded" in screen
    assert dead_ids(env) == [1001, 1002]

    # A dead letter that matches only after the question was asked is not deleted.
    code, screen = on_a_terminal(env, "y", "--reason", "no_route",
                                 before_answer=lambda: insert_dead_letters(env, 1, start=3))
    assert code == 0, screen
    assert "discarded 2 dead letters" in screen
    assert dead_ids(env) == [1003]
