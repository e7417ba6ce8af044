"""The picture of a trace in docs/python-api.md (docs/images/trace.png): the spans an
end-to-end run exported, as a timeline, drawn from the spans themselves.

    OUTBOX_TEST_TRACE_PNG=docs/images/trace.png ./dev test tests/integration/test_tracing.py

runs tests/integration/test_tracing.py, whose first test calls ``draw`` with the spans of its
run: the producer's and the inbox's (OpenTelemetry SDK's in-memory exporter, in the test's
process) and the relay's (devenv/traced_relay.py, a file). matplotlib is in the bench group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COLOURS = {"producer": "#4C72B0", "relay": "#8172B3", "consumer": "#DD8452",
           "handler": "#55A868"}
# The process each role's spans come from: an arrow is drawn between processes only.
PROCESS = {"producer": "orders", "relay": "relay", "consumer": "billing", "handler": "billing"}
LEGEND = {"producer": "producer's span (orders service)", "relay": "relay's publish span",
          "consumer": "inbox helper's span (billing service)", "handler": "handler's span"}


@dataclass(frozen=True)
class Span:
    """What the picture shows of a span."""

    name: str
    role: str  # a key of COLOURS
    span_id: int
    trace_id: int
    parent: int | None  # the parent's span id, in this trace
    links: tuple[int, ...]  # span ids linked to
    start: int  # ns
    end: int
    message_id: str | None = None


def from_sdk(span: Any) -> Span:
    """An OpenTelemetry SDK ReadableSpan of the producer's or the consumer's process."""
    kind = span.kind.name
    remote = span.parent is not None and span.parent.is_remote
    role = ("consumer" if kind == "CONSUMER" else
            "producer" if span.parent is None or remote else "handler")
    return Span(span.name, role, span.context.span_id, span.context.trace_id,
                None if span.parent is None else span.parent.span_id,
                tuple(link.context.span_id for link in span.links), span.start_time,
                span.end_time, (span.attributes or {}).get("messaging.message.id"))


def from_record(record: Any) -> Span:
    """A span of the relay's (devenv.traced_relay.SpanRecord)."""
    return Span(record.name, "relay", record.span_id, record.trace_id, record.parent,
                tuple(span_id for _trace, span_id in record.links), record.start, record.end)


def _rows(spans: Sequence[Span]) -> list[tuple[Span, int]]:
    """Depth first from the roots: a span's children (and the spans linked to it) under it,
    by start time."""
    ids = {span.span_id for span in spans}
    under: dict[int | None, list[Span]] = {}
    for span in spans:
        above = span.parent if span.parent in ids else next(
            (link for link in span.links if link in ids), None)
        under.setdefault(above, []).append(span)
    rows: list[tuple[Span, int]] = []

    def walk(above: int | None, depth: int) -> None:
        for span in sorted(under.get(above, []), key=lambda s: s.start):
            rows.append((span, depth))
            walk(span.span_id, depth + 1)

    walk(None, 0)
    return rows


def draw(spans: Sequence[Span], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = _rows(spans)
    where = {span.span_id: y for y, (span, _) in enumerate(rows)}
    start = min(span.start for span in spans)
    fig, ax = plt.subplots(figsize=(11, 0.42 * len(rows) + 2.0))
    labels = []
    for y, (span, depth) in enumerate(rows):
        left, width = (span.start - start) / 1e6, (span.end - span.start) / 1e6
        ax.barh(y, max(width, 0.4), left=left, height=0.6, color=COLOURS[span.role])
        ax.text(left + max(width, 0.4) + 1.5, y, f"{width:.1f} ms", va="center", fontsize=8)
        labels.append("    " * depth + span.name
                      + (f"  [{span.message_id}]" if span.message_id else ""))
        arrows = [(link, "dotted") for link in span.links if link in where]
        if span.parent is not None and span.parent in where:
            arrows.append((span.parent, "dashed"))
        for above, style in arrows:
            source = rows[where[above]][0]
            if PROCESS[source.role] == PROCESS[span.role]:
                continue  # a parent in the same process: the indent says it
            # From the bottom edge of the source's bar: its duration is written at its end.
            ax.annotate("", xy=(left, y), xytext=((source.end - start) / 1e6, where[above] + 0.3),
                        arrowprops={"arrowstyle": "->", "color": "grey", "linestyle": style})
    ax.set_yticks(range(len(rows)), labels, fontsize=9)
    ax.set_ylim(len(rows) - 0.4, -0.6)
    ax.set_xlabel("milliseconds since the first span began")
    ax.set_title("A trace across three processes: the producer's transaction, the relay's "
                 "batch, each event in the consumer's inbox", fontsize=10)
    roles = [role for role in COLOURS if any(span.role == role for span in spans)]
    ax.legend(handles=[Patch(color=COLOURS[role], label=LEGEND[role]) for role in roles] + [
        Line2D([], [], color="grey", linestyle="dashed",
               label="parent to child (the message's traceparent)"),
        Line2D([], [], color="grey", linestyle="dotted",
               label="link (the batch's span to each event's)")],
        loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
