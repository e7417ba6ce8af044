"""The relay with OpenTelemetry's SDK set up, for tests/integration/test_tracing.py:
``python -m devenv.traced_relay [outbox-relay arguments]``, with ``OUTBOX_SPANS_FILE`` naming
the file its spans are appended to, one JSON object a line (``read_spans`` reads them back).

A deployed relay gets its SDK from ``opentelemetry-instrument outbox-relay run`` and the
standard OTEL_* variables (docs/operations.md#tracing); this launcher of the checkout, which
the wheel does not ship, sets up the same SDK with a file as the exporter, so that a test can
draw the relay's spans with the producer's and the consumer's.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from outbox_relay.relay import cli

SPANS_FILE = "OUTBOX_SPANS_FILE"


class FileExporter(SpanExporter):
    """Each finished span as one JSON line: what ``read_spans`` and the picture need."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            context = span.get_span_context()
            assert context is not None  # a finished span of the SDK has one
            lines.append(json.dumps({
                "name": span.name, "kind": span.kind.name,
                "trace_id": context.trace_id, "span_id": context.span_id,
                "parent": None if span.parent is None else span.parent.span_id,
                "start": span.start_time, "end": span.end_time,
                "attributes": dict(span.attributes or {}),
                "links": [[link.context.trace_id, link.context.span_id] for link in span.links],
                "status": span.status.status_code.name}))
        with self._lock, self.path.open("a", encoding="utf-8") as out:
            out.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS


@dataclass(frozen=True)
class SpanRecord:
    """A span read back from the file."""

    name: str
    kind: str
    trace_id: int
    span_id: int
    parent: int | None
    start: int
    end: int
    attributes: dict[str, Any] = field(default_factory=dict)
    links: list[tuple[int, int]] = field(default_factory=list)
    status: str = "UNSET"


def read_spans(path: Path) -> list[SpanRecord]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text("utf-8").splitlines():
        value = json.loads(line)
        value["links"] = [tuple(link) for link in value["links"]]
        records.append(SpanRecord(**value))
    return records


def main(argv: Sequence[str] | None = None) -> int:
    provider = TracerProvider(resource=Resource.create({"service.name": "outbox-relay"}))
    provider.add_span_processor(SimpleSpanProcessor(FileExporter(Path(os.environ[SPANS_FILE]))))
    trace.set_tracer_provider(provider)
    try:
        return cli.main(argv)
    finally:
        provider.shutdown()


if __name__ == "__main__":
    sys.exit(main())
