"""An ephemeral agent's lifetime (issue 27): the agent a Slurm job's `srun` starts on each allocated
node (workers/slurm_agent.py) serves one attempt and exits when that attempt has ended on its node, so
the Slurm job ends with it (and its allocation goes back to Slurm). It also exits when no launch came
within IDLE_S (the control plane gave the attempt up while Slurm started it).

Slurm taking the node back (preemption's SIGTERM, `scancel --signal=TERM`, the time limit's warning)
reaches the agent as a SIGTERM: instead of killing its ranks (what a SIGTERM to a standing agent
does), it tells the control plane in an immediate heartbeat (`draining`), which asks the attempt to
checkpoint and stop (cooperative preemption: exit 83, the job requeued), and waits for the ranks to
end, up to WAIT_S; Slurm's GraceTime bounds the rest."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

from trainyard.launch import HEARTBEAT_TASK

log = logging.getLogger("trainyard.agent")
ONCE_VAR = "TRAINYARD_AGENT_ONCE"
IDLE_S = float(os.environ.get("TRAINYARD_AGENT_IDLE_S", "600"))
WAIT_S = 120.0


class Standing:
    """A standing agent (registered by staff): serves attempts until stopped; a SIGTERM stops them all."""

    allocation = ""  # a Slurm agent's SLURM_JOB_ID, in every heartbeat
    draining = ""    # set when Slurm takes the node back

    def __init__(self, agent):
        self.agent = agent

    def attempt_ended(self, attempt_id: int) -> None:
        pass

    def check_idle(self) -> None:
        pass

    def on_shutdown(self) -> None:
        self.agent.stop_all()


class Lifetime(Standing):
    def __init__(self, agent, attempt_id: int, idle_s: float = IDLE_S):
        super().__init__(agent)
        self.allocation = os.environ.get("TRAINYARD_SLURM_JOB_ID", "")
        self.attempt_id, self.idle_s = attempt_id, idle_s
        self.started = time.monotonic()
        self.done = threading.Event()

    @classmethod
    def from_env(cls, agent) -> "Lifetime | Standing":
        value = os.environ.get(ONCE_VAR, "")
        return cls(agent, int(value)) if value.isdigit() else Standing(agent)

    def attempt_ended(self, attempt_id: int) -> None:
        """Its attempt's exit was reported here: leave (after a second, for the report to go out)."""
        if attempt_id == self.attempt_id and not self.done.is_set():
            log.info("attempt %s ended here: this ephemeral agent exits", attempt_id)
            self.done.set()
            threading.Timer(1.0, os.kill, args=(os.getpid(), signal.SIGTERM)).start()

    def check_idle(self) -> None:
        with self.agent._registry_lock:
            busy = bool(self.agent.supervisors)
        launched = (self.agent.run_dir(self.attempt_id) / "launched").exists()
        if not busy and not launched and time.monotonic() - self.started > self.idle_s and not self.done.is_set():
            log.warning("no launch of attempt %s within %.0f s: this ephemeral agent exits", self.attempt_id, self.idle_s)
            self.done.set()
            os.kill(os.getpid(), signal.SIGTERM)

    def on_shutdown(self) -> None:
        """The worker is shutting down: our own exit (nothing left to stop), or Slurm taking the node back."""
        if self.done.is_set():
            self.agent.stop_all()
            return
        self.taken_back()

    def taken_back(self, wait_s: float = WAIT_S) -> None:
        agent = self.agent
        self.draining = "SIGTERM from Slurm (preemption, scancel or its time limit)"
        log.warning("%s: asking the control plane to checkpoint and stop attempt %s", self.draining, self.attempt_id)
        try:
            agent.report(HEARTBEAT_TASK, agent.heartbeat_payload().model_dump(mode="json"), expires=10)
        except Exception as exc:  # Redis away: the grace runs out, Slurm kills what is left
            log.warning("could not report the drain: %s", exc)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with agent._registry_lock:
                if not agent.supervisors:
                    break
            time.sleep(0.2)
        agent.stop_all()
