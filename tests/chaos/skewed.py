"""Run a module (``python skewed.py MODULE ARGS...``) with a ``time.sleep``
that works under libfaketime with monotonic time left alone.

libfaketime 0.9.10 turns ``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)``
into a call with a negative time (its issue #426), and Python 3.11's
``time.sleep`` makes exactly that call: EINVAL. A wait on an event that is
never set sleeps the same time through ``pthread_cond_timedwait``, which
libfaketime handles. Used by the chaos test only (tests/chaos/clock.py).
"""

import runpy
import sys
import threading
import time

_never = threading.Event()


def _sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    _never.wait(seconds)


time.sleep = _sleep
module = sys.argv[1]
sys.argv = [module, *sys.argv[2:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
