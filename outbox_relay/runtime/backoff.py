"""The one reconnection backoff of both programs: tenacity's full jitter (docs/operations.md).

A wait after the n-th failure in a row is uniform in [0, min(max_delay, INITIAL_DELAY * 2**(n-1))]:
relays restarted together do not retry in lockstep.
"""

from __future__ import annotations

import tenacity

# The first failure's ceiling; the tests shrink it (psycopg_pool style), read at each call.
INITIAL_DELAY = 0.2


def wait(max_delay: float) -> tenacity.wait.wait_base:
    """The backoff as a tenacity wait strategy (for ``tenacity.Retrying``)."""
    return tenacity.wait_random_exponential(multiplier=INITIAL_DELAY, max=max_delay)


def delay(failures: int, max_delay: float) -> float:
    """Seconds to wait after ``failures`` (>= 1) failures in a row."""
    state = tenacity.RetryCallState(_RETRYING, None, (), {})
    state.attempt_number = failures
    return wait(max_delay)(state)


_RETRYING = tenacity.Retrying()  # RetryCallState needs one; the strategy never reads it
