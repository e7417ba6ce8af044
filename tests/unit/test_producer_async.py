"""An asynchronous target takes ``await enqueue_async(...)``; a forgotten ``await`` must never
drop an event unnoticed. The synchronous names refuse an asynchronous target at once (the
caller's transaction then rolls back with the exception); a coroutine of the async names that
is never awaited is reported as soon as it is dropped, and type checkers flag it first."""

from __future__ import annotations

import asyncio
import gc
import logging
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_relay import Event, InvalidEvent, caller, enqueue, enqueue_many
from outbox_relay.producer import Enqueueing, enqueue_async, enqueue_many_async
from tests.conftest import ROOT
from tests.unit.test_producer import FakeCursor, good

NEVER_AWAITED = "was never awaited"


def async_connection() -> psycopg.AsyncConnection[Any]:
    """An AsyncConnection object without a server: the API tells targets apart by type."""
    return psycopg.AsyncConnection.__new__(psycopg.AsyncConnection)


@pytest.fixture
def executed(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What the asynchronous INSERT ran with (nothing runs without a server otherwise)."""
    calls: list[dict[str, Any]] = []

    async def run_async(target: Any, statement: caller.Statement,
                        params: dict[str, Any]) -> list[Any]:
        await asyncio.sleep(0)
        calls.append(params)
        return []

    monkeypatch.setattr(caller, "run_async", run_async)
    return calls


def test_the_sync_names_refuse_an_async_target_before_writing_anything(
        executed: list[dict[str, Any]]) -> None:
    conn = async_connection()
    with pytest.raises(TypeError, match=r"asynchronous: use `await enqueue_async\(\.\.\.\)`"):
        enqueue(conn, **good())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`await enqueue_many_async\(\.\.\.\)`"):
        enqueue_many(conn, [Event("", "q", 1)])  # type: ignore[arg-type]
    assert executed == []


def test_the_async_names_refuse_a_sync_target() -> None:
    cursor = FakeCursor()
    with pytest.raises(TypeError, match=r"synchronous: call enqueue\(\.\.\.\), without await"):
        enqueue_async(cursor, **good())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"call enqueue_many\(\.\.\.\)"):
        enqueue_many_async(cursor, [Event("", "q", 1)])  # type: ignore[arg-type]
    assert cursor.calls == []


def test_awaited_it_writes_the_event_and_returns_its_id(executed: list[dict[str, Any]]) -> None:
    async def main() -> tuple[str, list[str]]:
        conn = async_connection()
        one = await enqueue_async(conn, **good(message_id="m-1"))
        many = await enqueue_many_async(conn, [Event("", "q", 1, message_id="m-2"),
                                               Event("", "q", 2, message_id="m-3")])
        return one, many

    assert asyncio.run(main()) == ("m-1", ["m-2", "m-3"])
    assert [call["message_id"] for call in executed] == [["m-1"], ["m-2", "m-3"]]


def test_it_is_a_coroutine_to_asyncio(executed: list[dict[str, Any]]) -> None:
    async def main() -> list[Any]:
        conn = async_connection()
        task = asyncio.create_task(enqueue_async(conn, **good(message_id="t")))
        return [await task, *await asyncio.gather(
            enqueue_async(conn, **good(message_id="g")),
            enqueue_many_async(conn, [Event("", "q", 1, message_id="h")]))]

    pending = enqueue_async(async_connection(), **good(message_id="x"))
    assert asyncio.iscoroutine(pending) and isinstance(pending, Enqueueing)
    pending.close()
    assert asyncio.run(main()) == ["t", "g", ["h"]]
    assert len(executed) == 3


def test_a_bad_event_raises_at_the_call_before_any_await(
        executed: list[dict[str, Any]], caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(InvalidEvent):
        enqueue_async(async_connection(), **good(routing_key="r" * 256))
    assert executed == [] and caplog.records == []


def test_one_never_awaited_is_reported_when_it_is_dropped_with_its_ids_and_place(
        executed: list[dict[str, Any]], caplog: pytest.LogCaptureFixture) -> None:
    conn = async_connection()
    with pytest.warns(RuntimeWarning, match=NEVER_AWAITED) as warned:
        enqueue_async(conn, **good(message_id="forgotten-1")); line = sys._getframe().f_lineno  # noqa: E702
        # Reported at once, when the statement drops it: before anything else runs here.
        [record] = caplog.records
    assert (record.levelno, record.name) == (logging.ERROR, "outbox_relay")
    assert record.getMessage() == (
        f"enqueue_async() called at {__file__}:{line} was never awaited: 1 event(s) NOT "
        "written to the outbox (message id forgotten-1); write `await enqueue_async(...)`")
    # The warning is shown at the call, as Python's own for a coroutine never awaited.
    assert str(warned[0].message) == record.getMessage()
    assert (warned[0].filename, warned[0].lineno) == (__file__, line)
    assert executed == []


def test_a_batch_never_awaited_names_its_first_ids(caplog: pytest.LogCaptureFixture) -> None:
    events = [Event("", "q", n, message_id=f"b-{n}") for n in range(5)]
    with pytest.warns(RuntimeWarning):
        enqueue_many_async(async_connection(), events)
    assert "5 event(s) NOT written to the outbox (message id b-0, b-1, b-2 and 2 more); " \
           "write `await enqueue_many_async(...)`" in caplog.records[0].getMessage()


def test_awaited_or_closed_on_purpose_is_not_reported(
        executed: list[dict[str, Any]], caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        await enqueue_async(async_connection(), **good())

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        asyncio.run(main())
        enqueue_async(async_connection(), **good()).close()
        gc.collect()
    assert caplog.records == [] and len(executed) == 1


def test_it_cannot_be_awaited_twice(executed: list[dict[str, Any]]) -> None:
    async def main() -> None:
        pending = enqueue_async(async_connection(), **good())
        await pending
        with pytest.raises(RuntimeError, match="cannot reuse already awaited coroutine"):
            await pending

    asyncio.run(main())
    assert len(executed) == 1


@pytest.mark.slow
def test_mypy_flags_a_forgotten_await_and_an_async_target_of_the_sync_names(
        tmp_path: Path) -> None:
    """What a type checker says before the code ever runs (mypy --strict; unused-coroutine is
    on by default)."""
    (tmp_path / "service.py").write_text(textwrap.dedent('''
        import psycopg
        from outbox_relay import Event, enqueue, enqueue_async, enqueue_many_async

        async def pay(conn: psycopg.AsyncConnection[object],
                      cur: psycopg.AsyncCursor[object]) -> None:
            async with conn.transaction():
                enqueue_async(conn, exchange="", routing_key="q", payload={})
                enqueue_many_async(conn, [Event("", "q", 1)])
                enqueue(conn, exchange="", routing_key="q", payload={})
                enqueue(cur, exchange="", routing_key="q", payload={})
                await enqueue_async(conn, exchange="", routing_key="q", payload={})
                await enqueue_many_async(cur, [Event("", "q", 1)])
    '''))
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--hide-error-context",
         "--cache-dir", str(tmp_path / "cache"), str(tmp_path / "service.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    errors = [line.split(": error: ")[0].rsplit(":", 1)[1] + " " + line.rsplit("[", 1)[1]
              for line in done.stdout.splitlines() if ": error: " in line]
    assert errors == ["8 unused-coroutine]", "9 unused-coroutine]", "10 arg-type]",
                      "11 arg-type]"], done.stdout + done.stderr
