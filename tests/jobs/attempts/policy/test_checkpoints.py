"""Retention, resume point and rollback over checkpoint states (pure)."""
from jobs.attempts.policy.checkpoints import CheckpointState as C
from jobs.attempts.policy.checkpoints import resume_point, retention, rollback_supersedes


def line(*steps):
    return [C(i + 1, s, float(i)) for i, s in enumerate(steps)]


def test_resume_point_is_the_highest_live_step():
    cps = line(10, 20, 30)
    assert resume_point(cps).step == 30
    cps[2] = C(3, 30, 2.0, superseded=True)
    assert resume_point(cps).step == 20
    assert resume_point([C(1, 10, 0.0, deleted=True)]) is None
    assert resume_point([]) is None


def test_retention_keeps_newest_plus_pinned():
    cps = line(10, 20, 30, 40, 50)
    assert retention(cps, keep=3) == [1, 2]
    cps[0] = C(1, 10, 0.0, pinned=True)
    assert retention(cps, keep=3) == [2]
    # already deleted ones are not deleted twice
    assert retention([C(1, 10, 0.0, deleted=True), C(2, 20, 1.0)], keep=1) == []


def test_retention_keeps_recent_superseded_until_newer_ones_push_them_out():
    # 10, 20, 30 written; rollback to 10 supersedes 20 and 30; the new line writes 20' and 30'
    cps = [C(1, 10, 0.0), C(2, 20, 1.0, superseded=True), C(3, 30, 2.0, superseded=True)]
    assert retention(cps, keep=3) == []
    cps += [C(4, 20, 3.0)]
    assert retention(cps, keep=3) == []  # 2 is still among the 3 most recently registered
    cps += [C(5, 30, 4.0)]
    assert retention(cps, keep=3) == [2]
    cps += [C(6, 40, 5.0)]
    assert retention(cps, keep=3) == [1, 2, 3]  # live: 40, 30, 20 kept; 10 is the 4th


def test_retention_never_deletes_the_resume_point():
    cps = [C(1, 100, 0.0), C(2, 10, 1.0), C(3, 20, 2.0), C(4, 30, 3.0)]
    assert 1 not in retention(cps, keep=1)


def test_rollback_supersedes_same_and_later_steps_only():
    cps = [C(1, 10, 0.0), C(2, 20, 1.0), C(3, 30, 2.0), C(4, 20, 3.0, superseded=True)]
    assert rollback_supersedes(cps, cps[0]) == [2, 3]
    assert rollback_supersedes(cps, cps[3]) == [2, 3]
