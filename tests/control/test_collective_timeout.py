"""Issue 14 finding 5: every launch carries a collective timeout under the hang detector's, so a
collective stuck on a missing peer fails its rank with a real error before the attempt is
stopped as hung."""
import pytest
from django.conf import settings

from jobs.policy import diagnosis
from tests.control.test_services import start, submit
from trainyard.launch import Launch
from trainyard.sdk.config import parse_launch_config

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("hang", [120.0, "auto"])
def test_each_launch_carries_a_collective_timeout_under_the_hang_timeout(user, nodes, sent, hang,
                                                                         django_capture_on_commit_callbacks):
    job = submit(user, hang_timeout_s=hang)
    with django_capture_on_commit_callbacks(execute=True):
        start(job)
    launches = [Launch.model_validate(c[2]) for c in sent if c[0] == "launch"]
    assert len(launches) == 2
    floor = settings.TRAINYARD_HANG_FLOOR_S
    shortest_hang = hang if hang != "auto" else floor
    for launch in launches:
        assert launch.collective_timeout_s == pytest.approx(0.8 * shortest_hang)
        for recent in ([], [0.1] * 5, [30.0] * 5):  # whatever the steps, the detector waits longer
            check = diagnosis.hang_check(now=0, started=0, last_progress=0, spec_timeout=hang,
                                         recent_step_s=recent, floor_s=floor)
            assert launch.collective_timeout_s < check.timeout_s


def test_the_ranks_launch_config_reads_it_and_an_older_agents_config_has_none(tmp_path):
    raw = {"job_id": 1, "attempt_id": 2, "node": "n", "run_dir": str(tmp_path), "redis_url": "redis://x",
           "stream": "s", "data_root": str(tmp_path), "checkpoint_dir": str(tmp_path), "spec": {}}
    assert parse_launch_config(raw).collective_timeout_s is None
    assert parse_launch_config({**raw, "collective_timeout_s": 48.0}).collective_timeout_s == 48.0
