"""Heal in place (trainyard.sdk.heal, issue 24 section 3) through real processes: a torchft
lighthouse and two replicas, each under its own torchrun with --max-restarts. One replica's rank
is SIGKILLed mid-run; torchrun restarts it alone, it receives the model and optimizer state from
the live replica (no checkpoint exists at all), and both finish with the same parameters while
the survivor never restarted and never lost a committed step."""
from __future__ import annotations

import pytest

from trainyard.sdk.heal import HealEnv, HealError

from . import heal_procs

STEPS = 160


def test_env_names_what_is_missing_or_wrong():
    with pytest.raises(HealError, match="TRAINYARD_HEAL_REPLICA, .*TORCHFT_LIGHTHOUSE"):
        HealEnv.from_env({"MASTER_ADDR": "x", "MASTER_PORT": "1", "TRAINYARD_HEAL_REPLICAS": "2"})
    with pytest.raises(HealError, match="outside 0..1"):
        HealEnv.from_env({"TRAINYARD_HEAL_REPLICA": "2", "TRAINYARD_HEAL_REPLICAS": "2", "TORCHFT_LIGHTHOUSE": "h",
                          "MASTER_ADDR": "x", "MASTER_PORT": "1"})
    env = HealEnv.from_env({"TRAINYARD_HEAL_REPLICA": "1", "TRAINYARD_HEAL_REPLICAS": "2",
                            "TORCHFT_LIGHTHOUSE": "http://h:1", "MASTER_ADDR": "a", "MASTER_PORT": "29500"})
    assert (env.replica, env.replicas, env.store_port) == (1, 2, 29500)


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_a_killed_replica_heals_from_its_live_peer_and_the_survivor_loses_nothing(tmp_path):
    run = heal_procs.kill_one_replica(tmp_path, steps=STEPS, kill_after_step=40)
    assert run.codes == [0, 0], run.log_tail
    survivor, healed = run.replicas
    # the survivor never restarted, and from its first step (the one it started at: a replica that
    # joins after the other began is healed at its first quorum) committed every step once, in order
    assert [x["event"] for x in survivor].count("up") == 1
    done = heal_procs.committed(survivor)
    assert done == list(range(done[0], STEPS)), "the survivor lost or repeated a committed step"
    assert set(heal_procs.committed(healed)) | set(done) == set(range(STEPS))
    retried = heal_procs.retried(survivor)
    assert len(retried) <= 2, retried  # the step its peer died in, trained again with the next quorum
    # the killed replica came back once, received its state from the survivor at the survivor's step
    assert [x["event"] for x in healed].count("up") == 2
    heal = run.heal
    assert heal is not None and heal["step"] > run.killed_step, (heal, run.killed_step)
    assert heal_procs.committed(run.after_restart) == list(range(heal["step"], STEPS)), \
        "the healed replica did not continue at its peers' step"
    print(f"killed at step {run.killed_step}; healed at step {heal['step']} ({heal['load_s'] * 1000:.1f} ms to apply); "
          f"first healed step {run.kill_to_first_healed_step_s:.2f} s after the kill; survivor retried {retried}")
    # both replicas end with the same parameters
    assert run.digests[0] == run.digests[1]
