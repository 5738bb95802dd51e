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

    <python> -m workers.warmrun --standby <run_dir>/go.json

A standby (workers/standby.py): the same launcher started by the node agent ahead of need, in a
sandbox of its own, for the next attempt of a job running on the node. It imports and waits; the
agent hands it an attempt by writing go.json (read-only to it) with torchrun's arguments, the
ranks' environment and the working directory, and it goes on as above. Until then it holds no
credential and no attempt's environment: those arrive with go.json and the attempt's config.json.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import traceback
import time

MODULE = "workers.runtime"
# What torchrun's parent handles (its --signals-to-handle default): a fork inherits the handlers, and
# in a rank they would turn a stop's SIGTERM into a Python exception instead of the signal's death.
PARENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
GO_POLL_S = 0.02
# torchrun's c10d rendezvous polls the store for its peers once a second, reads of its state are
# cached for a second, and each node's first join is skewed by up to 0.3 s: about 1 s of every
# (re)start waits on these. Its store is on the node_rank-0 node; 20 reads a second from each node
# of one attempt are nothing to it.
RDZV_POLL_S = 0.05


def fast_rendezvous_polls() -> None:
    """Cap torch's rendezvous delays and state cache at RDZV_POLL_S (dynamic_rendezvous's _delay and
    _BackendRendezvousStateHolder's cache_duration, torch 2.13)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous, utils

    def delay(seconds: float | tuple[float, float]) -> None:
        low, high = seconds if isinstance(seconds, tuple) else (seconds, seconds)
        utils._delay((min(low, RDZV_POLL_S), min(high, RDZV_POLL_S)))

    holder = dynamic_rendezvous._BackendRendezvousStateHolder
    init = holder.__init__

    def holder_init(self, backend, settings, cache_duration: float = RDZV_POLL_S) -> None:
        init(self, backend, settings, min(cache_duration, RDZV_POLL_S))

    dynamic_rendezvous._delay = delay
    holder.__init__ = holder_init


def rank_main(*argv: str) -> None:
    """One rank, in the fork: the defaults for the signals the launcher handles, then the runtime."""
    for sig in PARENT_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    from workers.runtime.__main__ import main

    try:
        main(list(argv))
    except BaseException:
        # A fresh interpreter prints an uncaught error to its stderr, which torchrun keeps as the
        # rank's log; in a fork the error leaves torchrun's redirect first and went nowhere the
        # job's logs see (a user error before the rendezvous showed no line): print it here.
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        raise


def wait_for_go(path: str, poll_s: float = GO_POLL_S) -> dict:
    """The hand-over the agent writes into go.json (in place: the sandbox binds that file): argv,
    env, cwd. Empty until then; a half-written file is read again."""
    while True:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            if text.strip():
                go = json.loads(text)
                if isinstance(go, dict) and {"argv", "env", "cwd"} <= set(go):
                    return go
        except (OSError, ValueError):
            pass
        time.sleep(poll_s)


def standby(go_path: str) -> None:
    import workers.runtime.__main__  # noqa: F401  (everything a rank imports, before any attempt exists)

    go = wait_for_go(go_path)
    os.environ.clear()  # exactly the attempt's ranks' environment, as a fresh launcher would have it
    os.environ.update({str(k): str(v) for k, v in go["env"].items()})
    os.chdir(go["cwd"])
    main([str(a) for a in go["argv"]])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--standby"] and len(argv) == 2:
        return standby(argv[1])
    import workers.runtime.__main__  # noqa: F401  (torch and the runtime, once, before the rendezvous)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record

    fast_rendezvous_polls()
    args = torchrun.parse_args(argv)
    if not args.module or args.training_script != MODULE or args.no_python or args.run_path:
        raise SystemExit(f"workers.warmrun runs only `-m {MODULE}`, not {args.training_script!r}")
    args.start_method = "fork"
    config, _cmd, _cmd_args = torchrun.config_from_args(args)
    record(lambda: torchrun.elastic_launch(config=config, entrypoint=rank_main)(*args.training_script_args))()


if __name__ == "__main__":
    sys.exit(main())
