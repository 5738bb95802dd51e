"""Ending a rank's process without interpreter finalization: `exit_now(code)`, `main_then_exit(main)`.

torch's Gloo backend runs each collective on a C++ worker thread that drops its reference to the
work object a moment after the collective completes. When Python has already dropped the work's
tensors, that last drop decrefs their Python objects and takes the GIL; if the main thread has
meanwhile reached interpreter finalization (the script ended), taking the GIL ends the worker
thread with a forced unwind through a C++ frame that cannot unwind, and the process dies with
"terminate called without an active exception" (SIGABRT) after it did all its work. Seen in this
project's tests once in several full runs (test_sharded, test_sdk_torchrun) and reproduced 2 runs
in 10 of tests/workers/runtime/sharded_cases.py; the core's stack is Py_FinalizeEx in the main
thread and ProcessGroupGloo::runLoop -> ~AsyncAllgatherWork -> decref_pyobject -> take_gil ->
pthread_exit in a worker. `destroy_process_group()` does not prevent it: it shuts nothing down
that the worker is still holding. (pytorch/pytorch#179291 proposed a torch-side fix and was
abandoned.)

A process that has finished its work and flushed what it writes can skip finalization: nothing
of the run depends on it (telemetry is flushed by Reporter.close, checkpoints by the
checkpointer's close, files are closed by the OS), so no worker can race it. The built-in
runtime (workers/runtime/__main__.py) and the test scripts run under torchrun end this way.

A user's script through the SDK owns its process (code may follow `run.finish()`), so the SDK does
not end it. Instead, when the SDK creates a gloo process group (trainyard.sdk.run.init_process_group),
`settle_at_exit()` registers an atexit handler that sleeps SETTLE_S: atexit handlers run while the
interpreter is still whole, so the workers drop their last references before finalization starts.
Unlike os._exit it cannot change the script's exit code, and costs SETTLE_S once per process.
Measured on tests/workers/runtime/sharded_cases.py ending with a plain main() under torchrun, 2
ranks: 3 aborts in 50 runs without it (2 in 30 quiet, 1 in 20 under two CPU hogs), 0 in 90 with it
(60 quiet, 30 under the hogs). A script can still end with `main_then_exit(main)` to skip
finalization altogether.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from typing import NoReturn

SETTLE_S = 0.1
_settling = False


def exit_now(code: int = 0) -> NoReturn:
    """Flush the logging handlers, stdout and stderr, then end the process with `code` at once
    (os._exit: no atexit handlers, no finalization)."""
    try:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    finally:
        os._exit(code)


def main_then_exit(main) -> NoReturn:
    """main(), then exit_now(0); a SystemExit with a number (the SDK's Preempted is 83) exits with
    it the same way. Anything else propagates as usual."""
    try:
        main()
    except SystemExit as stop:
        if not isinstance(stop.code, int):
            raise
        exit_now(stop.code)
    exit_now(0)


def settle_at_exit() -> None:
    """Before interpreter finalization, give torch's gloo worker threads SETTLE_S to drop their last
    references to finished collectives (an atexit handler; registered once per process)."""
    global _settling
    if not _settling:
        atexit.register(time.sleep, SETTLE_S)
        _settling = True
