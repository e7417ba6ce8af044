"""Fixture: the OpenTelemetry SDK with an in-memory exporter as the process's tracer provider
(set once per process, as OpenTelemetry allows), its spans cleared for each test."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


@cache
def _exporter() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The finished spans of this test (``spans.get_finished_spans()``)."""
    exporter = _exporter()
    exporter.clear()
    yield exporter
    exporter.clear()


def tracer() -> trace.Tracer:
    """A tracer for the test's own spans (the producer's, the handler's)."""
    _exporter()
    return trace.get_tracer("tests")
