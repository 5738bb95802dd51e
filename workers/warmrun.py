"""torchrun for the built-in runtime with the runtime already imported: its ranks are forked from it.

    <python> -m workers.warmrun <torchrun's arguments> -m workers.runtime --config <run_dir>/config.json

Started the usual way, torchrun imports torch, rendezvouses, and then starts each rank as a new
interpreter that imports torch and the runtime again (about 2.5 s of a 2-core machine's time, after
the rendezvous, on every start and every restart). Here the launcher imports the runtime once,
before its rendezvous, and each rank is a fork of it (torchrun's own `--start-method fork` with a
function entrypoint): what a rank does first is the runtime's own work. Everything else is
torchrun's: its arguments, rendezvous, per-rank environment, log redirection, error files and exit
codes.

Isolation is the same as a fresh interpreter's: the launcher runs inside the attempt's sandbox
(workers/sandbox.py: its uid, its binds, its environment, nothing of any other attempt), and it holds
nothing a rank would not have: the parent has run no user code and no training code, only imports.
User code (a JobSpec `entrypoint`, under its own interpreter) keeps torchrun's usual start.
"""
from __future__ import annotations

import signal
import sys

MODULE = "workers.runtime"
# What torchrun's parent handles (its --signals-to-handle default): a fork inherits the handlers, and
# in a rank they would turn a stop's SIGTERM into a Python exception instead of the signal's death.
PARENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def rank_main(*argv: str) -> None:
    """One rank, in the fork: the defaults for the signals the launcher handles, then the runtime."""
    for sig in PARENT_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    from workers.runtime.__main__ import main

    main(list(argv))


def main(argv: list[str] | None = None) -> None:
    import workers.runtime.__main__  # noqa: F401  (torch and the runtime, once, before the rendezvous)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record

    args = torchrun.parse_args(argv)
    if not args.module or args.training_script != MODULE or args.no_python or args.run_path:
        raise SystemExit(f"workers.warmrun runs only `-m {MODULE}`, not {args.training_script!r}")
    args.start_method = "fork"
    config, _cmd, _cmd_args = torchrun.config_from_args(args)
    record(lambda: torchrun.elastic_launch(config=config, entrypoint=rank_main)(*args.training_script_args))()


if __name__ == "__main__":
    sys.exit(main())
