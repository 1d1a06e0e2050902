"""Exponential back-off that cannot overflow.

Every retry loop of pgq and of the cluster doubles a delay up to a cap:
``first * 2 ** attempt``, at most ``cap``. Written out inline, the power
grows with the attempt count long after the cap is reached, and at attempt
1024 its conversion to a float raises ``OverflowError``: a client
reconnecting for more than about 17 minutes, a federation broadcast to a
queue empty for 8.5 hours, or an ACK collection waiting 51 hours on a dead
holder crashed the loop that ran it. Here the exponent stops at 60, far
past any cap (2**60 of the smallest first delay is decades).
"""

from __future__ import annotations

__all__ = ["doubling"]

MAX_DOUBLINGS = 60


def doubling(first: float, attempt: int, cap: float) -> float:
    """``first`` doubled ``attempt`` times, at most ``cap``."""
    return min(first * 2.0 ** min(max(attempt, 0), MAX_DOUBLINGS), cap)
