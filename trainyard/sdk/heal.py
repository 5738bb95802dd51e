"""Heal in place (issue 24, section 3): data-parallel replicas that outlive one another's failures,
on torchft (https://github.com/pytorch/torchft).

Each data-parallel replica is a replica group of its own: its own torchrun (`--max-restarts`
restarts it alone), its own process group. A lighthouse (torchft's quorum server, one per job)
joins them. Every step each live replica enters a quorum, and the gradients are averaged over the
replicas in it (torchft's DistributedDataParallel + its reconfigurable gloo/NCCL group). When a
replica dies the others keep training without it, their state in memory. When torchrun has
restarted it, its first quorum finds it behind: it receives the model and optimizer state from a
live peer over HTTP (torchft's checkpoint transport) instead of from disk, and trains on at the
step the others are on. Only what failed recovers: no replica repeats a step, and what is lost is
the failed replica's share of the steps it was away (the survivors' gradients are averaged over
the replicas that took part in each step).

    healing = Healing(model, optimizer)            # the replica's identity from the environment
    while healing.step < steps:
        healing.begin()                            # a quorum; heals this replica if it is behind
        loss = loss_fn(healing.model(batch_for(healing.step, healing.replica)), ...)
        loss.backward()
        healing.commit()                           # the optimizer step, if the quorum held

Environment (what a launch sets): TRAINYARD_HEAL_REPLICA (this replica's index),
TRAINYARD_HEAL_REPLICAS (how many), TORCHFT_LIGHTHOUSE (http://host:port), and torchrun's
MASTER_ADDR/MASTER_PORT for the replica group's own store.

`python -m trainyard.sdk.heal lighthouse --bind HOST:PORT` serves a lighthouse until it is killed.

Scope: the SDK and its tests run it through real torchrun processes (tests/workers/runtime/
test_heal.py, bench/recovery.py's `heal` side); the cluster does not launch jobs this way yet
(docs/architecture.md, "Heal in place").
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch import nn

REPLICA_VAR, REPLICAS_VAR, LIGHTHOUSE_VAR = "TRAINYARD_HEAL_REPLICA", "TRAINYARD_HEAL_REPLICAS", "TORCHFT_LIGHTHOUSE"


class HealError(RuntimeError):
    """The environment does not describe a healing replica."""


@dataclass(frozen=True)
class HealEnv:
    replica: int
    replicas: int
    lighthouse: str
    store_addr: str
    store_port: int

    @classmethod
    def from_env(cls, environ: dict | None = None) -> HealEnv:
        e = os.environ if environ is None else environ
        missing = [v for v in (REPLICA_VAR, REPLICAS_VAR, LIGHTHOUSE_VAR, "MASTER_ADDR", "MASTER_PORT") if not e.get(v)]
        if missing:
            raise HealError(f"heal in place needs {', '.join(missing)} in the environment")
        try:
            replica, replicas, port = int(e[REPLICA_VAR]), int(e[REPLICAS_VAR]), int(e["MASTER_PORT"])
        except ValueError as exc:
            raise HealError(f"heal in place: {exc}") from None
        if not 0 <= replica < replicas:
            raise HealError(f"{REPLICA_VAR}={replica} is outside 0..{replicas - 1}")
        return cls(replica, replicas, e[LIGHTHOUSE_VAR], e["MASTER_ADDR"], port)


@dataclass
class Healed:
    """One state this replica received from a live peer instead of from disk."""
    step: int  # the step it resumed at (the peers' step)
    load_s: float  # applying the received state
    at: float = field(default_factory=time.time)


class Healing:
    """A model and optimizer trained as one replica of a healing data-parallel job."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, env: HealEnv | None = None,
                 timeout_s: float = 10.0, extra_state: Callable[[], dict] | None = None,
                 load_extra: Callable[[dict], None] | None = None) -> None:
        from torchft import Manager, ProcessGroupGloo

        self.env = env or HealEnv.from_env()
        self.healed: list[Healed] = []
        self._module = model  # unwrapped: what a peer's state is read from and loaded into
        self._extra_state, self._load_extra = extra_state, load_extra
        timeout = timedelta(seconds=timeout_s)
        self.manager = Manager(
            # a synchronous quorum: a replica behind is healed inside begin(), so `step` is right from there
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1, use_async_quorum=False, load_state_dict=self._load,
            state_dict=self._state, replica_id=f"replica-{self.env.replica}", timeout=timeout,
            quorum_timeout=timedelta(seconds=max(timeout_s, 30.0)), rank=0, world_size=1,
            store_addr=self.env.store_addr, store_port=self.env.store_port, lighthouse_addr=self.env.lighthouse)
        self.model = _replicated(self.manager, model)
        self.optimizer = optimizer

    @property
    def replica(self) -> int:
        return self.env.replica

    @property
    def step(self) -> int:
        """The job's step this replica trains next (the peers' step after a heal)."""
        return self.manager.current_step()

    @property
    def participants(self) -> int:
        """Replicas in the current quorum (fewer than `replicas` while one is away)."""
        return self.manager.num_participants()

    def begin(self) -> None:
        """Start the step: join the quorum (healing first if behind) and zero the gradients."""
        self.manager.start_quorum()
        self.optimizer.zero_grad()

    def commit(self) -> bool:
        """The optimizer step when every participant's gradients arrived. False: a peer failed
        during the step, nothing was applied, and the same step is trained again with the next
        quorum (`step` did not move)."""
        if not self.manager.should_commit():
            return False
        self.optimizer.step()
        return True

    def _state(self) -> dict:
        state = {"model": self._module.state_dict(), "optim": self.optimizer.state_dict()}
        if self._extra_state is not None:
            state["extra"] = self._extra_state()
        return state

    def _load(self, state: dict) -> None:
        t0 = time.perf_counter()
        self._module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        if self._load_extra is not None and "extra" in state:
            self._load_extra(state["extra"])
        self.healed.append(Healed(step=self.manager.current_step(), load_s=time.perf_counter() - t0))


def _replicated(manager, module: nn.Module) -> nn.Module:
    """torch's DDP over a dummy group, its buckets averaged by the manager's fault-tolerant allreduce.

    torchft 0.2.0's own DistributedDataParallel asserts in its comm hook when a peer dies during
    the allreduce (the managed future is never set after the failed wait), which kills the
    survivor: the one failure heal in place exists for. Here a failed allreduce only marks the
    manager errored; the step is then not committed (`commit()` is False) and the next quorum
    goes on without the dead peer."""
    from torch.nn.parallel import DistributedDataParallel
    from torchft.process_group import ProcessGroupDummy

    def average(state, bucket):
        buf = bucket.buffer()
        state.allreduce(buf).wait()  # averages buf in place; on an error, reports it to the manager
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut

    # find_unused_parameters: torchft's own setting, so the reducer never rebuilds its buckets
    # (a healed replica's would differ from its peers')
    ddp = DistributedDataParallel(module, process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True)
    ddp.register_comm_hook(manager, average)
    return ddp


def serve_lighthouse(bind: str, min_replicas: int = 1, join_timeout_ms: int = 100):
    """A lighthouse serving `bind` (host:port, port 0 for any); `.address()` says where."""
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import signal

    ap = argparse.ArgumentParser(prog="python -m trainyard.sdk.heal", description="a heal-in-place lighthouse")
    sub = ap.add_subparsers(dest="cmd", required=True)
    lh = sub.add_parser("lighthouse", help="serve a lighthouse until killed")
    lh.add_argument("--bind", default="[::]:0", help="host:port to listen on")
    lh.add_argument("--min-replicas", type=int, default=1)
    args = ap.parse_args(argv)
    server = serve_lighthouse(args.bind, args.min_replicas)
    print(server.address(), flush=True)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.shutdown()


if __name__ == "__main__":
    main()
