"""What each statement cost PostgreSQL, bucket by bucket (``--statements``).

The outbox's buffers per event say whether the claims' work grew under a held snapshot; they do
not say which statement's did, nor see the work of a statement that is slow for other reasons.
With ``--statements`` the scenario's PostgreSQL loads pg_stat_statements (every statement,
nested ones too) and this sampler reads it at the end of every bucket: per statement, the
calls, milliseconds and buffers of that bucket, the costliest first. (Found this way, not by
the buffers: the stats passes' full pass walking a held snapshot's dead entries,
docs/performance.md.) Statements are named by their text, comments and whitespace left out;
sql/queries.sql holds the programs' ones. The sampler's own reads are left out.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import psycopg

# PostgreSQL settings that load the extension (the server must start with them).
SERVER_CONF = {"shared_preload_libraries": "pg_stat_statements",
               "pg_stat_statements.track": "all", "pg_stat_statements.max": "1000"}
TOP = 8  # statements kept per bucket

_READ = """
SELECT queryid, query, calls, total_exec_time,
       shared_blks_hit + shared_blks_read + local_blks_hit + local_blks_read
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND query NOT LIKE '%pg_stat_statements%'
"""
_COMMENT = re.compile(r"--[^\n]*|/\*.*?\*/", re.DOTALL)


def label(query: str, width: int = 100) -> str:
    """A statement's text without its comments, whitespace collapsed, cut at ``width``."""
    text = " ".join(_COMMENT.sub(" ", query).split())
    return text if len(text) <= width else text[:width - 3] + "..."


Counters = dict[int, tuple[str, int, float, int]]  # queryid: (label, calls, ms, buffers)


def top(before: Counters, after: Counters, count: int = TOP) -> dict[str, Any]:
    """The statements that cost most between two readings, and the total of all of them."""
    rows: list[dict[str, Any]] = []
    for queryid, (text, calls, ms, buffers) in after.items():
        _, calls0, ms0, buffers0 = before.get(queryid, (text, 0, 0.0, 0))
        if calls > calls0:
            rows.append({"statement": text, "calls": calls - calls0, "ms": round(ms - ms0, 1),
                         "ms_per_call": round((ms - ms0) / (calls - calls0), 3),
                         "buffers": buffers - buffers0})
    rows.sort(key=lambda row: row["ms"], reverse=True)
    return {"total_ms": round(sum(row["ms"] for row in rows), 1), "top": rows[:count]}


class Sampler:
    """Reads pg_stat_statements at ``origin + k * bucket`` for every k until stopped, on a
    thread and a connection of its own."""

    def __init__(self, db_url: str, origin: float, bucket: float) -> None:
        self._url, self._origin, self._bucket = db_url, origin, bucket
        self._stop = threading.Event()
        self.buckets: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        """Create the extension (here, so that a server without it fails the run), then read
        on the thread: every bucket's figures are differences of two readings."""
        with psycopg.connect(self._url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        self._thread.start()

    def stop(self) -> list[dict[str, Any]]:
        """Stop at once (the bucket under way is not read); the buckets read, in order."""
        self._stop.set()
        self._thread.join()
        return self.buckets

    def _read(self, conn: psycopg.Connection[Any]) -> Counters:
        counters: Counters = {}
        for queryid, query, calls, ms, buffers in conn.execute(_READ):
            text, calls0, ms0, buffers0 = counters.get(queryid, (label(query), 0, 0.0, 0))
            counters[queryid] = (text, calls0 + calls, ms0 + ms, buffers0 + buffers)
        return counters

    def _run(self) -> None:
        with psycopg.connect(self._url, autocommit=True) as conn:
            before = self._read(conn)
            index = int((time.monotonic() - self._origin) // self._bucket)
            while not self._stop.wait(max(0.0, self._origin + (index + 1) * self._bucket
                                          - time.monotonic())):
                after = self._read(conn)
                self.buckets.append({"from_s": index * self._bucket, **top(before, after)})
                before, index = after, index + 1
