"""Named SQL: every query the code asks for exists, and table names compose as quoted identifiers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from psycopg import sql

from outbox_relay import postgres
from outbox_relay import sql as sql_files
from outbox_relay.prepared import PreparedStatement, numbered
from outbox_relay.schema import schema_sql
from outbox_relay.sql import expand_fragments, parse_named
from outbox_relay.tables import Tables, table_name
from tests.conftest import package_sources

ROOT = Path(__file__).resolve().parents[2]


def used_query_names() -> set[str]:
    """Every ``.query("name")`` in the package's source."""
    source = "\n".join(p.read_text() for p in package_sources())
    return set(re.findall(r"\.query\(\s*\"(\w+)\"", source))


def queries() -> dict[str, str]:
    return expand_fragments(parse_named((ROOT / "sql" / "queries.sql").read_text()))


# -- parse_named ------------------------------------------------------------------------------


def test_parse_named_splits_sections_and_drops_the_preamble() -> None:
    text = "-- a file comment\n\n-- name: one\nSELECT 1;\n\n-- name: two\n-- a comment\nSELECT 2;\n"

    assert parse_named(text) == {"one": "SELECT 1;", "two": "-- a comment\nSELECT 2;"}


def test_parse_named_needs_the_marker_at_line_start() -> None:
    assert parse_named("SELECT 1; -- name: inline\n") == {}


def test_parse_named_of_empty_text_is_empty() -> None:
    assert parse_named("") == {}


def test_fragments_stand_where_queries_name_them_and_are_no_queries() -> None:
    named = parse_named("-- name: _even\n-- a comment\nn % 2 = 0\n\n"
                        "-- name: q\nSELECT 1 WHERE ({_even}) OR NOT ({_even});\n")

    assert expand_fragments(named) == {
        "q": "SELECT 1 WHERE (-- a comment\nn % 2 = 0) OR NOT (-- a comment\nn % 2 = 0);"}


def test_fragments_may_name_fragments_but_not_in_a_cycle() -> None:
    named = parse_named("-- name: _a\nx = 1 AND {_b}\n-- name: _b\ny = 2\n"
                        "-- name: q\nSELECT 1 WHERE {_a};\n")

    assert expand_fragments(named) == {"q": "SELECT 1 WHERE x = 1 AND y = 2;"}
    with pytest.raises(ValueError, match="cycle"):
        expand_fragments({"_a": "{_b}", "_b": "{_a}", "q": "{_a}"})


def test_every_fragment_is_used_and_no_placeholder_is_left() -> None:
    named = parse_named((ROOT / "sql" / "queries.sql").read_text())
    fragments = {name for name in named if name.startswith("_")}

    assert fragments  # stats_lowest's walks share theirs
    for fragment in fragments:
        assert any(f"{{{fragment}}}" in body for body in named.values()), fragment
    assert not any("{_" in body for body in queries().values())


def test_every_query_used_by_the_code_is_defined() -> None:
    used = used_query_names()

    assert {"claim", "dead_letter_claimed", "forget_delivered", "record_failures",
            "dead_letter_exhausted", "stats", "server_check"} <= used
    assert used <= set(queries())


def test_every_defined_query_is_non_empty_and_used() -> None:
    defined = queries()

    assert all(body.strip() for body in defined.values())
    assert set(defined) == used_query_names()


def test_shipped_queries_are_the_ones_the_package_loads() -> None:
    tables = Tables("outbox")

    for name in queries():
        assert tables.query(name).as_string(None)


# -- Tables -----------------------------------------------------------------------------------


def test_plain_table_names() -> None:
    tables = Tables("outbox")

    assert tables.name == "outbox"
    assert tables.dead_letter_name == "outbox_dead_letter"
    assert tables.outbox.as_string(None) == '"outbox"'
    assert tables.dead_letter.as_string(None) == '"outbox_dead_letter"'
    assert tables.message_id_index.as_string(None) == '"outbox_message_id_key"'
    assert tables.retry_index.as_string(None) == '"outbox_retry_idx"'


def test_schema_qualified_names_quote_each_part() -> None:
    tables = Tables("billing.events")

    assert tables.outbox.as_string(None) == '"billing"."events"'
    assert tables.dead_letter.as_string(None) == '"billing"."events_dead_letter"'
    assert tables.dead_letter_name == "billing.events_dead_letter"
    # An index lives in its table's schema: its name is never qualified.
    assert tables.message_id_index.as_string(None) == '"events_message_id_key"'


@pytest.mark.parametrize("name", sorted({"claim", "forget_delivered", "record_failures",
                                         "dead_letter_exhausted", "dead_letter_claimed", "stats"}))
def test_outbox_queries_use_the_configured_tables(name: str) -> None:
    text = Tables("billing.events").query(name).as_string(None)

    assert '"billing"."events"' in text or '"billing"."events_dead_letter"' in text
    assert "{outbox}" not in text and "{dead_letter}" not in text
    assert re.search(r"\bFROM outbox\b|\bINTO outbox\b", text) is None


def test_claim_locks_without_waiting_and_deletes_what_it_claims() -> None:
    text = Tables("outbox").query("claim").as_string(None)

    # Both branches (a retry row alone, fresh rows) lock only outbox rows they claim: the fresh
    # branch locks the rows it chose, each by its ctid; its LATERAL read of each key's head
    # row locks nothing.
    assert text.count("FOR UPDATE SKIP LOCKED") == 2
    # The lock checks again, on a row changed since the snapshot (its last version), that
    # it is still fresh, due and of the same key: PostgreSQL rechecks these after following
    # the update, where the look's checks are not run again.
    lock = text[text.index("WHERE o.ctid = c.tid"):text.index("FOR UPDATE SKIP LOCKED) AS l")]
    assert "o.attempts <= 0 AND o.available_at <= now()" in lock
    assert "o.ordering_key IS NOT DISTINCT FROM c.ordering_key" in lock
    assert 'DELETE FROM "outbox"' in text
    assert "%(limit)s" in text
    assert "NOTIFY" not in text.upper()


def test_bind_parameters_are_left_for_the_driver() -> None:
    text = Tables("outbox").query("record_failures").as_string(None)

    assert {"%(ids)s", "%(errors)s", "%(base_delay)s", "%(max_delay)s"} <= set(
        re.findall(r"%\(\w+\)s", text))


def test_longest_valid_table_name_keeps_companion_names_within_63_bytes() -> None:
    name = table_name("s" * 40 + "." + "t" * 40)
    tables = Tables(name)

    for ident in (tables.dead_letter, tables.message_id_index, tables.retry_index):
        assert all(len(part) <= 63 for part in ident.as_string(None).strip('"').split('"."'))


# -- the schema -------------------------------------------------------------------------------


def test_schema_composes_for_a_qualified_table() -> None:
    text = Tables("billing.events").schema().as_string(None)

    assert 'CREATE TABLE IF NOT EXISTS "billing"."events" (' in text
    assert 'CREATE TABLE IF NOT EXISTS "billing"."events_dead_letter" (' in text
    assert 'CREATE UNIQUE INDEX IF NOT EXISTS "events_message_id_key" ON "billing"."events"' in text
    assert 'CREATE INDEX IF NOT EXISTS "events_retry_idx" ON "billing"."events"' in text
    assert "DEFAULT '{}'::jsonb" in text
    assert "{outbox}" not in text


def test_schema_text_is_the_sql_folder_file() -> None:
    assert sql_files.text("schema.sql") == (ROOT / "sql" / "schema.sql").read_text("utf-8")


def test_schema_sql_is_the_composed_schema() -> None:
    assert schema_sql("outbox") == Tables("outbox").schema().as_string(None)


# -- how the startup check names the tables ---------------------------------------------------


class RecordingConnection:
    """Just enough of a psycopg connection for postgres.check_server."""

    def __init__(self, row: tuple[Any, ...]) -> None:
        self.row = row
        self.params: dict[str, Any] = {}

    def execute(self, query: Any, params: dict[str, Any]) -> RecordingConnection:
        self.params = params
        return self

    def fetchone(self) -> tuple[Any, ...]:
        return self.row


def test_check_server_looks_up_both_tables() -> None:
    conn = RecordingConnection((64, True, True, 160000))

    postgres.check_server(conn, Tables("billing.events"))  # type: ignore[arg-type]

    assert conn.params == {"outbox": '"billing"."events"',
                           "dead_letter": '"billing"."events_dead_letter"'}


def test_mixed_case_table_is_refused_by_config_or_looked_up_quoted() -> None:
    try:
        table_name("MyOutbox")
    except ValueError:
        return
    conn = RecordingConnection((64, True, True, 160000))

    postgres.check_server(conn, Tables("MyOutbox"))  # type: ignore[arg-type]

    assert conn.params["outbox"] == Tables("MyOutbox").outbox.as_string(None)


def test_a_prepared_statement_numbers_each_name_once_and_executes_with_literals() -> None:
    text, names = numbered("SELECT %(a)s, format('%%s of %%%%', %(b)s) WHERE x > %(a)s "
                           "LIMIT %(c)s")
    assert (text, names) == ("SELECT $1, format('%s of %%', $2) WHERE x > $1 LIMIT $3",
                             ["a", "b", "c"])
    statement = PreparedStatement("s", sql.SQL("SELECT {} WHERE id > %(after)s LIMIT %(limit)s "
                                           "OR %(one)s").format(sql.Identifier("a b")))
    assert statement.params == ["after", "limit", "one"]  # before any session
    executed = statement.execute_query({"limit": 200, "one": True, "after": 7, "unused": "x"})
    assert executed.as_string(None) == 'EXECUTE "s" (7, 200, true)'
    claim = PreparedStatement("outbox_relay_claim", Tables("outbox").query("claim"))
    assert sorted(claim.params) == ["after", "floor", "held", "limit", "max_bytes",
                                    "max_message_bytes", "max_row_bytes", "one_row_at_least"]
