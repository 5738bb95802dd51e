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
runtime (workers/runtime/__main__.py) and the test scripts run under torchrun end this way. A user's
script through the SDK is still exposed: it owns its process (code may follow `run.finish()`), so
the SDK does not end it; such a script can end with `main_then_exit(main)` itself.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


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
