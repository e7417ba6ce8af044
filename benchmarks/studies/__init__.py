"""Finished studies: one-off measurements whose results are recorded in the docs, kept runnable.

``./dev bench`` (benchmarks/__main__.py) runs none of them. Each is ``python -m
benchmarks.studies.<name>``:

- ``instructions``: callgrind's instruction counts of ``to_message`` and of the claim statement,
  a row (benchmarks/NOTEBOOK.md; the smoke run: tests/acceptance/test_instructions_smoke.py);
- ``claims``: what each claim returns at the relays' steady state, without a broker, and with
  ``--callgrind`` what it costs PostgreSQL (tests/acceptance/test_claims_smoke.py);
- ``claim_cost``: one small claim's round trip and PostgreSQL's work by statement, as at a
  steady low load (benchmarks/NOTEBOOK.md; tests/acceptance/test_claims_smoke.py);
- ``stats_query``: what the relays' table-wide lag and backlog query costs (docs/operations.md);
- ``callgrind``: the PostgreSQL under callgrind that the first two share.
"""
