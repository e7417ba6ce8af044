"""Packaging: one installed name, one version everywhere, the licence declared is the licence
shipped, the wheel holds what the API and the programs need at run time (their SQL, py.typed),
it depends on plain psycopg (psycopg's binary build is the extra the image installs), the
integrations are optional extras that the image does not install, and the developers'
dependencies are dependency groups, not extras."""

from __future__ import annotations

import email
import fnmatch
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import outbox_relay
from outbox_relay.version import __version__
from tests.conftest import ROOT

PYPROJECT = (ROOT / "pyproject.toml").read_text("utf-8")  # no tomllib before Python 3.11


def docker_ignored(relative: str) -> bool:
    """Whether .dockerignore keeps ``relative`` out of the image's build context (the subset of
    Docker's rules the file uses: names, ``*`` patterns, ``**/`` prefixes, trailing ``/``)."""
    patterns = [line.strip().rstrip("/") for line in
                (ROOT / ".dockerignore").read_text("utf-8").splitlines()
                if line.strip() and not line.startswith("#")]
    parts = relative.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    for pattern in patterns:
        if pattern.startswith("**/"):
            if any(fnmatch.fnmatch(part, pattern[3:]) for part in parts):
                return True
        elif any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes):
            return True
    return False


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel built as the Dockerfile builds it: from the context .dockerignore leaves."""
    context = tmp_path_factory.mktemp("context") / "src"

    def ignore(directory: str, names: list[str]) -> set[str]:
        base = Path(directory).relative_to(ROOT)
        return {n for n in names if docker_ignored(str(base / n).removeprefix("./"))}

    shutil.copytree(ROOT, context, ignore=ignore)
    assert not (context / "tests").exists() and (context / "outbox_relay").is_dir()
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                            str(out), str(context)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    [path] = out.glob("outbox_relay-*.whl")
    return zipfile.ZipFile(path)


def metadata(wheel: zipfile.ZipFile) -> email.message.Message:
    [name] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.message_from_bytes(wheel.read(name))


@pytest.mark.parametrize("program", ["outbox_relay.relay", "outbox_relay.resolver",
                                     "outbox_relay.inbox_cli"])
def test_every_program_prints_the_one_version(program: str) -> None:
    done = subprocess.run([sys.executable, "-m", program, "--version"], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == __version__ == outbox_relay.__version__


def test_the_version_is_written_once() -> None:
    assert not re.search(r'(?m)^version\s*=\s*"', PYPROJECT)  # no literal version
    assert re.search(r'(?m)^dynamic = \["version"\]$', PYPROJECT)
    assert re.search(r'(?m)^\[tool\.setuptools\.dynamic\]\n'
                     r'version = \{attr = "outbox_relay\.version\.__version__"\}$', PYPROJECT)
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    changelog = (ROOT / "CHANGELOG.md").read_text("utf-8")
    assert f"## [{__version__}]" in changelog


def test_the_declared_licence_is_the_shipped_one() -> None:
    assert re.search(r'(?m)^license = "Apache-2.0"$', PYPROJECT)
    text = (ROOT / "LICENSE").read_text("utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_the_wheel_holds_the_api_its_sql_its_types_and_its_licence(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for needed in ("outbox_relay/__init__.py", "outbox_relay/py.typed", "outbox_relay/producer.py",
                   "outbox_relay/inbox.py", "outbox_relay/relay/worker.py",
                   "outbox_relay/resolver/worker.py", "outbox_relay/runtime/loop.py"):
        assert needed in names, needed
    # Every SQL file, as package data of outbox_relay.sql.
    for sql_file in (ROOT / "sql").glob("*.sql"):
        assert f"outbox_relay/sql/{sql_file.name}" in names, sql_file.name
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    meta = metadata(wheel)
    assert meta["Version"] == __version__
    assert meta["License-Expression"] == "Apache-2.0"
    # A user's extras only: the developers' test and bench sets are dependency groups.
    assert set(meta.get_all("Provides-Extra") or []) == {"binary", "sqlalchemy", "aio-pika",
                                                         "otel"}
    requires = meta.get_all("Requires-Dist") or []
    # The integrations are extras only: a plain install brings none.
    plain = [r for r in requires if "extra ==" not in r]
    assert not [r for r in plain if re.match(
        r"(?i)(sqlalchemy|aio-pika|django|pytest|opentelemetry)", r)], plain
    [otel] = [r for r in requires if 'extra == "otel"' in r]
    assert otel.startswith("opentelemetry-api"), otel  # the API only: the SDK is the service's
    # Plain psycopg, as psycopg asks of libraries; its binary build only through the extra.
    [psycopg] = [r for r in plain if re.match(r"psycopg\b", r)]
    assert re.match(r"psycopg *[<>=]", psycopg) and "[" not in psycopg, psycopg
    [binary] = [r for r in requires if 'extra == "binary"' in r]
    assert binary.startswith("psycopg[binary]"), binary
    assert "Typing :: Typed" in (meta.get_all("Classifier") or [])
    [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = wheel.read(entry_points).decode()
    for script in ("outbox-relay = outbox_relay.relay.cli:main",
                   "outbox-resolver = outbox_relay.resolver.cli:main",
                   "outbox-inbox = outbox_relay.inbox_cli:main"):
        assert script in scripts


def test_the_wheel_installs_one_top_level_name(wheel: zipfile.ZipFile) -> None:
    """relay/, resolver/ and sql/ ship inside outbox_relay: PyPI has projects named relay and
    resolver, and a service with a folder of either name must still import outbox_relay."""
    tops = {name.split("/")[0] for name in wheel.namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"outbox_relay"}
    [top_level] = [n for n in wheel.namelist() if n.endswith(".dist-info/top_level.txt")] or [""]
    if top_level:
        assert wheel.read(top_level).decode().split() == ["outbox_relay"]
    # Each program's folder ships whole under its installed name.
    for folder, package in (("relay", "outbox_relay/relay"), ("resolver", "outbox_relay/resolver"),
                            ("sql", "outbox_relay/sql")):
        for path in (ROOT / folder).glob("*.py"):
            assert f"{package}/{path.name}" in wheel.namelist(), path


def test_a_service_with_its_own_relay_folder_imports_the_api(tmp_path: Path) -> None:
    """The ImportError users met: a service whose own code has relay/ and resolver/ packages."""
    for own in ("relay", "resolver"):
        (tmp_path / own).mkdir()
        (tmp_path / own / "__init__.py").write_text("MINE = True\n")
    code = ("import outbox_relay, relay, resolver; from outbox_relay.relay import worker; "
            "print(relay.MINE, resolver.MINE, outbox_relay.enqueue.__name__)")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "enqueue"]


def test_the_image_installs_the_binary_extra_and_no_other() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text("utf-8")
    installs = re.findall(r"pip (?:install|wheel)[^\n]*", dockerfile)
    assert installs == ['pip wheel ".[binary]" --wheel-dir /wheels',
                        'pip install --no-index --find-links=/wheels "outbox-relay[binary]"'], installs


def test_the_developers_dependencies_are_groups_that_pip_installs() -> None:
    """PEP 735 groups, which the pip ./dev upgrades to installs (25.1 or newer)."""
    assert re.search(r"(?m)^\[dependency-groups\]\ntest = \[", PYPROJECT)
    assert re.search(r"(?m)^bench = \[", PYPROJECT)
    optional = PYPROJECT.split("[project.optional-dependencies]")[1].split("\n[")[0]
    assert not re.search(r"(?m)^(test|bench) =", optional)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps",
                           "--no-index", "-q", "--group", "test", "--group", "bench", "--report",
                           "-"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    # --no-index: nothing is fetched; the groups are installed here, so pip resolves them from
    # this environment (a pip without --group exits 2, "no such option"; a group it cannot find
    # fails with "not found").
    assert done.returncode == 0, done.stderr
    assert "ERROR" not in done.stderr, done.stderr


def test_the_public_api_is_typed_and_exported() -> None:
    assert Path(outbox_relay.__file__).with_name("py.typed").exists()
    for name in outbox_relay.__all__:
        assert hasattr(outbox_relay, name), name
