"""Ends a distributed test worker without the interpreter's teardown.

A worker has checked and reported everything by the time it returns, but the teardown that
follows can still abort the process now and then ("terminate called without an active
exception", SIGABRT): gloo's threads and the tensors their finished work holds are destroyed
while the interpreter finalizes (a known torch.distributed issue, seen here about once in 40
runs). A worker that succeeded therefore leaves with os._exit(0); one that failed raises as
usual, so its error still reaches the test.
"""

from __future__ import annotations

import functools
import os
import sys


def exit_without_teardown() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def exits_without_teardown(worker):
    """Decorator for mp.spawn workers: os._exit(0) once the worker returned."""

    @functools.wraps(worker)
    def run(*args, **kwargs):
        worker(*args, **kwargs)
        exit_without_teardown()

    return run
