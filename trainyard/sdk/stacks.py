"""Stack dumps on request: what a hung rank was doing, in its own stderr (torch-free).

The node agent sends STACK_SIGNAL to every rank of an attempt the control plane judged hung and
waits a moment before stopping it. `faulthandler` answers at the C level, so the dump comes also
while the main thread is blocked inside a collective (a Python signal handler would wait for it
to return); the rank's stderr reaches the job's log stream and the failure's log tail, one
stream per rank. A rank that registered nothing is not signalled (the agent checks that the
process catches the signal: its default action would kill it).
"""
from __future__ import annotations

import faulthandler
import signal
import sys

STACK_SIGNAL = signal.SIGUSR1


def install_stack_dump() -> bool:
    """Dump every thread's stack to stderr on STACK_SIGNAL. False where the platform has no
    faulthandler.register (Windows) or the process has no usable stderr."""
    if not hasattr(faulthandler, "register") or sys.stderr is None:
        return False
    try:
        faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    except (ValueError, OSError, AttributeError):  # stderr without a file descriptor
        return False
    return True
