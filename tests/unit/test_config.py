"""Settings: precedence, validation, error messages that name the setting and hide secrets."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from outbox_relay import tables
from outbox_relay.errors import ConfigError
from outbox_relay.relay.settings import RELAY_OPTIONS, RelaySettings
from outbox_relay.resolver.settings import RESOLVER_OPTIONS, ResolverSettings
from outbox_relay.runtime import options
from outbox_relay.runtime.options import resolve

REQUIRED = {"OUTBOX_DATABASE_URL": "postgresql://relay:pw@db:5432/app",
            "OUTBOX_AMQP_URL": "amqp://relay:pw@mq:5672/"}


def ns(**flags: Any) -> argparse.Namespace:
    return argparse.Namespace(**flags)


def relay_values(flags: dict[str, Any] | None = None, /, **env: str) -> dict[str, Any]:
    return resolve(ns(**(flags or {})), RELAY_OPTIONS, {**REQUIRED, **env})


def relay_error(flags: dict[str, Any] | None = None, /, **env: str) -> str:
    with pytest.raises(ConfigError) as info:
        relay_values(flags, **env)
    return str(info.value)


# -- precedence -------------------------------------------------------------------------------


def test_flag_wins_over_env_and_default() -> None:
    values = relay_values({"batch_size": "7"}, OUTBOX_BATCH_SIZE="9")

    assert values["batch_size"] == 7


def test_env_wins_over_default() -> None:
    assert relay_values(OUTBOX_BATCH_SIZE="9")["batch_size"] == 9


def test_default_applies_when_neither_flag_nor_env_is_set() -> None:
    values = relay_values()

    assert values["batch_size"] == 2000
    assert values["table"] == "outbox"
    assert values["gid_prefix"] == "outbox"


def test_empty_env_var_counts_as_unset() -> None:
    assert relay_values(OUTBOX_BATCH_SIZE="")["batch_size"] == 2000


def test_values_are_parsed_to_their_types() -> None:
    values = relay_values(OUTBOX_CONFIRM_TIMEOUT="2.5", OUTBOX_METRICS_PORT="0")

    assert values["confirm_timeout"] == 2.5
    assert isinstance(values["confirm_timeout"], float)
    assert values["metrics_port"] == 0


def test_resolve_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in REQUIRED.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("OUTBOX_MAX_ATTEMPTS", "4")

    assert resolve(ns(), RELAY_OPTIONS)["max_attempts"] == 4


@pytest.mark.parametrize(("options", "settings"), [
    (RELAY_OPTIONS, RelaySettings), (RESOLVER_OPTIONS, ResolverSettings)])
def test_option_defaults_match_the_settings_defaults(options: tuple[options.Option[Any], ...],
                                                      settings: type[Any]) -> None:
    values = resolve(ns(), options, REQUIRED)
    defaults = {f.name: f.default for f in dataclasses.fields(settings)
                if f.default is not dataclasses.MISSING}

    assert {k: v for k, v in values.items() if k in defaults} == defaults
    assert set(values) == {f.name for f in dataclasses.fields(settings)}


def test_add_options_makes_flags_whose_help_names_the_env_var() -> None:
    parser = argparse.ArgumentParser()
    options.add_options(parser, RELAY_OPTIONS)
    help_text = " ".join(parser.format_help().split())

    assert parser.parse_args(["--batch-size", "3"]).batch_size == "3"
    assert parser.parse_args([]).batch_size is None
    assert "env OUTBOX_BATCH_SIZE; default: 2000" in help_text
    assert "env OUTBOX_DATABASE_URL or OUTBOX_DATABASE_URL_FILE; required" in help_text


def test_each_settings_field_is_declared_by_an_option_of_the_same_name() -> None:
    for settings in (RelaySettings, ResolverSettings):
        declared = options.options_of(settings)
        assert [o.dest for o in declared] == [f.name for f in dataclasses.fields(settings)]
        assert len({o.env for o in declared}) == len(declared)

    @dataclasses.dataclass(frozen=True)
    class Undeclared:
        batch_size: int = 5

    with pytest.raises(TypeError, match=r"Undeclared\.batch_size is not declared"):
        options.options_of(Undeclared)


def test_settings_fields_have_the_type_their_parser_returns() -> None:
    values = resolve(ns(), RELAY_OPTIONS, REQUIRED)
    for item in dataclasses.fields(RelaySettings):
        assert type(values[item.name]).__name__ == item.type, item.name


# -- required and secret settings -------------------------------------------------------------


def test_missing_required_setting_names_env_var_and_flag() -> None:
    with pytest.raises(ConfigError,
                       match=r"^OUTBOX_AMQP_URL \(or --amqp-url, OUTBOX_AMQP_URL_FILE\) is required$"):
        resolve(ns(), RELAY_OPTIONS, {"OUTBOX_DATABASE_URL": REQUIRED["OUTBOX_DATABASE_URL"]})


@pytest.mark.parametrize("url", ["mysql://relay:hunter2@db/app", "relay:hunter2@db:5432",
                                 "http://relay:hunter2@db/app",
                                 "postgresql://relay:hunter2%zz@db/app",
                                 "postgresql://relay:hunter2@db/app?no_such_option=1"])
def test_bad_database_url_is_refused_without_showing_it(url: str) -> None:
    message = relay_error(OUTBOX_DATABASE_URL=url)

    assert message.startswith("OUTBOX_DATABASE_URL ")
    assert "hunter2" not in message
    assert "<hidden>" in message


@pytest.mark.parametrize("url", ["http://guest:hunter2@mq/", "amqpx://guest:hunter2@mq/",
                                 "guest:hunter2@mq"])
def test_bad_amqp_url_is_refused_without_showing_it(url: str) -> None:
    message = relay_error(OUTBOX_AMQP_URL=url)

    assert message == "OUTBOX_AMQP_URL must start with amqp:// or amqps:// (got <hidden>)"


@pytest.mark.parametrize("option", [options.DATABASE_URL, options.AMQP_URL])
def test_secret_urls_are_read_from_the_file_their_FILE_variable_names(
    option: options.Option[Any], tmp_path: Path
) -> None:
    secret = tmp_path / "url"
    secret.write_text(REQUIRED[option.env] + "\n")  # as `echo url > file` writes it
    env = {key: value for key, value in REQUIRED.items() if key != option.env}

    values = resolve(ns(), RELAY_OPTIONS, {**env, f"{option.env}_FILE": str(secret)})

    assert values[option.dest] == REQUIRED[option.env]


def test_the_flag_wins_over_a_FILE_variable(tmp_path: Path) -> None:
    secret = tmp_path / "url"
    secret.write_text("amqp://from-file/")
    values = resolve(ns(amqp_url="amqp://from-flag/"), RELAY_OPTIONS,
                     {**REQUIRED, "OUTBOX_AMQP_URL": "", "OUTBOX_AMQP_URL_FILE": str(secret)})

    assert values["amqp_url"] == "amqp://from-flag/"


def test_a_variable_and_its_FILE_form_together_are_refused(tmp_path: Path) -> None:
    secret = tmp_path / "url"
    secret.write_text("amqp://u:hunter2@mq/")

    message = relay_error(OUTBOX_AMQP_URL_FILE=str(secret))

    assert message == "OUTBOX_AMQP_URL and OUTBOX_AMQP_URL_FILE are both set: set only one"


@pytest.mark.parametrize(("content", "reason"), [
    (None, "a file that cannot be read: '{path}' (No such file or directory)"),
    ("dir", "a file that cannot be read: '{path}' (Is a directory)"),
    (b"", "an empty file: '{path}'"),
    (b" \n", "an empty file: '{path}'"),
    (b"amqp://u:hunter2\xff@mq/", "a file that is not UTF-8 text: '{path}'"),
    (b"amqp://u:hunter2@mq/" + b"x" * 70000, "a file larger than 64 KiB: '{path}'"),
])
def test_an_unusable_secret_file_is_one_line_naming_the_variable_never_its_content(
    content: bytes | str | None, reason: str, tmp_path: Path
) -> None:
    path = tmp_path / "secret"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    env = {"OUTBOX_DATABASE_URL": REQUIRED["OUTBOX_DATABASE_URL"],
           "OUTBOX_AMQP_URL_FILE": str(path)}

    with pytest.raises(ConfigError) as info:
        resolve(ns(), RELAY_OPTIONS, env)

    message = str(info.value)
    assert message == "OUTBOX_AMQP_URL_FILE names " + reason.format(path=path)
    assert "hunter2" not in message and "\n" not in message


def test_a_bad_url_in_a_secret_file_names_the_FILE_variable_and_hides_the_url(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("mysql://u:hunter2@db/app\n")

    message = relay_error(OUTBOX_DATABASE_URL="", OUTBOX_DATABASE_URL_FILE=str(path))

    assert message.startswith("OUTBOX_DATABASE_URL_FILE ")
    assert message.endswith("(got <hidden>)")
    assert "hunter2" not in message


def test_only_secrets_have_a_FILE_form() -> None:
    assert {o.env for o in RELAY_OPTIONS if o.file_env} == {"OUTBOX_DATABASE_URL", "OUTBOX_AMQP_URL"}
    assert "OUTBOX_TABLE_FILE" not in options.env_names(RELAY_OPTIONS)
    assert "OUTBOX_AMQP_URL_FILE" in options.env_names(RESOLVER_OPTIONS)


def test_bad_url_given_as_flag_names_the_flag_and_hides_it() -> None:
    message = relay_error({"database_url": "mysql://u:hunter2@db/app"})

    assert message.startswith("--database-url ")
    assert "hunter2" not in message


@pytest.mark.parametrize("url", ["postgresql://u:p@db/app", "postgres://db/app",
                                 "postgresql:///app?host=/run/postgresql"])
def test_postgres_url_schemes_are_accepted(url: str) -> None:
    assert relay_values(OUTBOX_DATABASE_URL=url)["database_url"] == url


@pytest.mark.parametrize("url", ["amqp://guest:guest@localhost:5672/%2F", "amqps://mq.example/"])
def test_amqp_url_schemes_are_accepted(url: str) -> None:
    assert relay_values(OUTBOX_AMQP_URL=url)["amqp_url"] == url


# -- validators -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [
    'out"box', "outbox;drop table x", "a.b.c", "1outbox", "a" * 41, "my schema.outbox",
    "schema.", ".outbox", "out-box", "outbox'", "sch.tab" + "x" * 38, "ünïcode",
])
def test_bad_table_names_are_refused(name: str) -> None:
    message = relay_error(OUTBOX_TABLE=name)

    assert message.startswith("OUTBOX_TABLE must be a table name")
    assert repr(name) in message


@pytest.mark.parametrize("name", ["outbox", "myschema.outbox", "a" * 40, "_x", "S1.T_2",
                                  "a" * 40 + "." + "b" * 40])
def test_plain_table_names_are_accepted(name: str) -> None:
    assert tables.table_name(name) == name


@pytest.mark.parametrize("prefix", ["a" * 33, "Outbox", "1relay", "out'box", 'out"box', "a:b",
                                    "a b", "-x"])
def test_bad_gid_prefixes_are_refused(prefix: str) -> None:
    message = relay_error(OUTBOX_GID_PREFIX=prefix)

    assert message.startswith("OUTBOX_GID_PREFIX must be 1-32 characters")


@pytest.mark.parametrize("prefix", ["a", "a" * 32, "relay-eu_1"])
def test_good_gid_prefixes_are_accepted(prefix: str) -> None:
    assert relay_values(OUTBOX_GID_PREFIX=prefix)["gid_prefix"] == prefix


@pytest.mark.parametrize(("env", "value"), [
    ("OUTBOX_BATCH_SIZE", "0"), ("OUTBOX_BATCH_SIZE", "-5"), ("OUTBOX_BATCH_SIZE", "1.5"),
    ("OUTBOX_BATCH_SIZE", "many"), ("OUTBOX_MAX_ATTEMPTS", "0"),
    ("OUTBOX_MAX_MESSAGE_BYTES", "-1"), ("OUTBOX_CONFIRM_TIMEOUT", "0"),
    ("OUTBOX_CONFIRM_TIMEOUT", "-1"), ("OUTBOX_CONFIRM_TIMEOUT", "nan"),
    ("OUTBOX_RETRY_BASE_DELAY", "-0.5"), ("OUTBOX_RETRY_MAX_DELAY", "-1"),
    ("OUTBOX_POLL_MIN_INTERVAL", "-0.001"), ("OUTBOX_POLL_MAX_INTERVAL", "0"),
    ("OUTBOX_STATS_INTERVAL", "0"), ("OUTBOX_CONNECT_TIMEOUT", "-3"),
    ("OUTBOX_RECONNECT_MAX_DELAY", "0"), ("OUTBOX_METRICS_PORT", "-1"),
    ("OUTBOX_METRICS_PORT", "65536"),
])
def test_bad_numbers_are_refused_naming_the_env_var_and_value(env: str, value: str) -> None:
    message = relay_error(**{env: value})

    assert message.startswith(f"{env} ")
    assert message.endswith(f"(got {value!r})")


@pytest.mark.parametrize(("env", "value"), [
    ("OUTBOX_LOG_LEVEL", "TRACE"), ("OUTBOX_LOG_LEVEL", "info"), ("OUTBOX_LOG_FORMAT", "xml"),
    ("OUTBOX_LEDGER_STREAM", "bad stream"), ("OUTBOX_LEDGER_STREAM", "x" * 201),
    ("OUTBOX_LEDGER_MAX_AGE", "7d"), ("OUTBOX_LEDGER_MAX_AGE", "0D"), ("OUTBOX_LEDGER_MAX_AGE", "D"),
    ("OUTBOX_LEDGER_MAX_AGE", "7 D"),
])
def test_bad_choices_streams_and_ages_are_refused(env: str, value: str) -> None:
    assert relay_error(**{env: value}).startswith(f"{env} must be")


@pytest.mark.parametrize("age", ["7D", "12h", "90m", "1Y", "6M", "3600s"])
def test_rabbitmq_max_ages_are_accepted(age: str) -> None:
    assert relay_values(OUTBOX_LEDGER_MAX_AGE=age)["ledger_max_age"] == age


def test_flag_error_names_the_flag() -> None:
    assert relay_error({"batch_size": "0"}).startswith("--batch-size must be a positive integer")


@pytest.mark.parametrize(("env", "value"), [
    ("OUTBOX_TABLE", "outbox\n"), ("OUTBOX_GID_PREFIX", "outbox\n"),
    ("OUTBOX_LEDGER_STREAM", "outbox.ledger\n"), ("OUTBOX_LEDGER_MAX_AGE", "7D\n"),
])
def test_trailing_newline_is_refused(env: str, value: str) -> None:
    relay_error(**{env: value})


# -- cross-field checks -----------------------------------------------------------------------


def test_poll_min_above_max_is_refused() -> None:
    with pytest.raises(ConfigError, match="OUTBOX_POLL_MIN_INTERVAL must not exceed OUTBOX_POLL_MAX"):
        RelaySettings("postgresql://db", "amqp://mq", poll_min_interval=1.0,
                      poll_max_interval=0.5)


def test_retry_base_above_max_is_refused() -> None:
    with pytest.raises(ConfigError, match="OUTBOX_RETRY_BASE_DELAY must not exceed OUTBOX_RETRY_MAX"):
        RelaySettings("postgresql://db", "amqp://mq", retry_base_delay=10.0, retry_max_delay=5.0)


def test_equal_min_and_max_are_accepted() -> None:
    settings = RelaySettings("postgresql://db", "amqp://mq", poll_min_interval=0.5,
                             poll_max_interval=0.5, retry_base_delay=2.0, retry_max_delay=2.0)

    assert settings.poll_min_interval == settings.poll_max_interval == 0.5


@pytest.mark.parametrize(("query", "reason"), [
    ("ssl_options=%7B%27ca_certs%27%3A%20%27%2Fnowhere%2Fca.pem%27%7D", "FileNotFoundError"),
    ("ssl_options=not-a-literal", "ValueError"),
    ("ssl_options=%7B%27certfile%27%3A%20%27x.pem%27%7D", "TypeError"),  # no CA given
    ("heartbeat=often", "ValueError"),
])
def test_amqp_url_options_pika_cannot_use_are_refused_up_front(query: str, reason: str) -> None:
    message = relay_error(OUTBOX_AMQP_URL=f"amqps://guest:hunter2@mq:5671/%2F?{query}")

    assert message.startswith(f"OUTBOX_AMQP_URL has options pika cannot use ({reason}: ")
    assert message.endswith(" (got <hidden>)")
    assert "hunter2" not in message


def test_amqps_url_with_a_ca_file_is_accepted(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(tmp_path / "ca.key"), "-out", str(ca), "-days", "1", "-subj", "/CN=test"],
                   check=True, capture_output=True, timeout=60)
    url = "amqps://guest:guest@mq:5671/%2F?" + urllib.parse.urlencode(
        {"ssl_options": repr({"ca_certs": str(ca), "server_hostname": "mq.example"})})

    assert relay_values(OUTBOX_AMQP_URL=url)["amqp_url"] == url


# -- hostile values (issue 10) ----------------------------------------------------------------


@pytest.mark.parametrize("env", [
    "OUTBOX_CONFIRM_TIMEOUT", "OUTBOX_CONNECT_TIMEOUT", "OUTBOX_RECONNECT_MAX_DELAY",
    "OUTBOX_RETRY_BASE_DELAY", "OUTBOX_RETRY_MAX_DELAY", "OUTBOX_POLL_MIN_INTERVAL",
    "OUTBOX_POLL_MAX_INTERVAL", "OUTBOX_STATS_INTERVAL"])
@pytest.mark.parametrize("value", ["inf", "Infinity", "-inf", "nan", "1e309", "604801",
                                   "99999999999999999999"])
def test_infinite_and_absurd_seconds_are_refused(env: str, value: str) -> None:
    message = relay_error(**{env: value})

    assert message.startswith(f"{env} must be a number of seconds")
    assert message.endswith(f"(got {value!r})")


@pytest.mark.parametrize("env", ["OUTBOX_RESOLVER_INTERVAL", "OUTBOX_RESOLVER_HARD_LIMIT",
                                 "OUTBOX_LEDGER_READ_MARGIN", "OUTBOX_LEDGER_READ_TIMEOUT"])
@pytest.mark.parametrize("value", ["inf", "nan", "1e309"])
def test_resolver_refuses_infinite_seconds(env: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"^{env} must be a number of seconds"):
        resolve(ns(), RESOLVER_OPTIONS, {**REQUIRED, env: value})


@pytest.mark.parametrize(("env", "value"), [
    ("OUTBOX_BATCH_SIZE", "99999999999999999999"), ("OUTBOX_BATCH_SIZE", "1000001"),
    ("OUTBOX_MAX_ATTEMPTS", "99999999999999999999"),
    ("OUTBOX_MAX_MESSAGE_BYTES", "99999999999999999999"),
    ("OUTBOX_MAX_MESSAGE_BYTES", str(512 * 1024 * 1024 + 1)),
    ("OUTBOX_BATCH_MAX_BYTES", "0"), ("OUTBOX_BATCH_MAX_BYTES", "99999999999999999999"),
])
def test_absurd_sizes_are_refused(env: str, value: str) -> None:
    message = relay_error(**{env: value})

    assert message.startswith(f"{env} must be ")
    assert " to " in message


def test_largest_sane_values_are_accepted() -> None:
    values = relay_values(OUTBOX_CONFIRM_TIMEOUT="604800", OUTBOX_BATCH_SIZE="1000000",
                          OUTBOX_MAX_MESSAGE_BYTES=str(512 * 1024 * 1024))

    assert values["confirm_timeout"] == 604800.0
    assert values["batch_size"] == 1_000_000


@pytest.mark.parametrize("url", [
    "amqp://relay:Xq/Zw@mq:5672/%2F", "amqp://relay:Xq#Zw@mq:5672/%2F",
    "amqp://relay:Xq?Zw@mq:5672/%2F", "amqp://relay:12/Zw@mq:5672/%2F",
    "amqps://relay:5671/Zw@mq/%2F", "amqp://relay:Xq?heartbeat=5@mq/",
])
def test_amqp_password_with_unencoded_delimiters_never_leaks(url: str) -> None:
    message = relay_error(OUTBOX_AMQP_URL=url)

    assert message.startswith("OUTBOX_AMQP_URL ")
    assert "Xq" not in message and "Zw" not in message
    assert "percent-encode" in message
    assert message.endswith("(got <hidden>)")


@pytest.mark.parametrize("url", [
    "postgresql://relay:se/cret@db/app", "postgresql://relay:5432/cret@db/app",
    "postgresql://relay:se%zzcret@db/app",
])
def test_postgres_password_with_unencoded_delimiters_never_leaks(url: str) -> None:
    message = relay_error(OUTBOX_DATABASE_URL=url)

    assert "cret" not in message
    assert "percent-encode" in message
    assert message.endswith("(got <hidden>)")


@pytest.mark.parametrize("url", ["postgresql://relay:se%2Fcret@db/app",
                                 "postgresql://relay:s#cr?t@db/app", "postgresql://relay:se:cret@db/app",
                                 "postgresql://db/app?user=a%40b"])
def test_encoded_or_libpq_safe_passwords_are_accepted(url: str) -> None:
    assert relay_values(OUTBOX_DATABASE_URL=url)["database_url"] == url


def test_amqp_password_percent_encoded_is_accepted() -> None:
    url = "amqp://relay:se%2Fc%23r%3Ft@mq:5672/%2F"

    assert relay_values(OUTBOX_AMQP_URL=url)["amqp_url"] == url


def test_ledger_stream_in_the_reserved_amq_namespace_is_refused() -> None:
    assert relay_error(OUTBOX_LEDGER_STREAM="amq.ledger").startswith(
        "OUTBOX_LEDGER_STREAM must not start with amq.")


def test_resolver_knows_the_outbox_table_for_the_ledger_key() -> None:
    values = resolve(ns(), RESOLVER_OPTIONS, {**REQUIRED, "OUTBOX_TABLE": "billing.events"})

    assert values["table"] == "billing.events"


@pytest.mark.parametrize(("env", "value"), [
    ("OUTBOX_COMPACT_LOCK_TIMEOUT", "0"), ("OUTBOX_COMPACT_MAX_BLOCK", "-1"),
    ("OUTBOX_COMPACT_MAX_BLOCK", "inf"), ("OUTBOX_COMPACT_ATTEMPTS", "0"),
    ("OUTBOX_COMPACT_ATTEMPTS", "10001"),
])
def test_bad_compact_settings_are_refused_naming_the_env_var(env: str, value: str) -> None:
    from outbox_relay.relay.cli import COMPACT_OPTIONS

    with pytest.raises(ConfigError) as info:
        resolve(ns(), COMPACT_OPTIONS, {**REQUIRED, env: value})
    assert str(info.value).startswith(f"{env} ")
    assert str(info.value).endswith(f"(got {value!r})")


def test_compact_defaults_bound_the_writers_wait() -> None:
    from outbox_relay.relay.cli import COMPACT_OPTIONS

    values = resolve(ns(), COMPACT_OPTIONS, REQUIRED)
    assert (values["lock_timeout"], values["max_block"], values["attempts"]) == (0.1, 2.0, 30)
