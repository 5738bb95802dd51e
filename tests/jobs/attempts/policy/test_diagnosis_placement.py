"""A cuda job whose rank found no usable CUDA where it was placed (issue 16, section 4): the node's
or the placement's failure, retried elsewhere with that node excluded, never the user's error.
Table-driven with the texts torch 2.x raises (the first two captured from this CPU build of torch
2.13, and checked live below)."""
import pytest

from jobs.attempts.policy.diagnosis import NODE_FAULT_CLASSES, diagnose

TB = ('Traceback (most recent call last):\n  File "/srv/trainyard/trainyard/sdk/run.py", line 88, in init\n'
      '    torch.cuda.set_device(local_rank)\n')


def rep(node, message, tb=TB):
    return {"node": node, "exit_code": 1, "signal": None, "log_tail": {},
            "failures": [{"rank": 0, "timestamp": 10.0, "message": message, "traceback": tb + message,
                          "signal": None}]}


NO_CUDA = [
    "AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'",
    "AssertionError: Torch not compiled with CUDA enabled",
    "RuntimeError: No CUDA GPUs are available",
    "RuntimeError: Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU and installed "
    "a driver from http://www.nvidia.com/Download/index.aspx",
    "RuntimeError: CUDA error: no CUDA-capable device is detected",
    "RuntimeError: The NVIDIA driver on your system is too old (found version 10020). Please update your GPU "
    "driver by downloading and installing a new version from the URL: http://www.nvidia.com/Download/index.aspx",
    "RuntimeError: CUDA error: CUDA driver version is insufficient for CUDA runtime version",
]


@pytest.mark.parametrize("message", NO_CUDA)
def test_cuda_job_without_cuda_on_its_node_is_a_placement_failure_retried_elsewhere(message):
    d = diagnose([rep("node-a", message), {"node": "node-b", "exit_code": 1, "failures": []}], device="cuda")
    assert d.failure_class == "placement" and d.retry
    assert d.node == "node-a" and d.exclude == ("node-a",)
    assert d.message.startswith("CUDA is not available on node-a: ")
    assert "placement" not in NODE_FAULT_CLASSES  # a job's own CPU-only `python` says the same


@pytest.mark.parametrize("message", NO_CUDA[:2])
def test_a_cpu_job_calling_cuda_is_still_the_users_error(message):
    d = diagnose([rep("node-a", message)], device="cpu")
    assert d.failure_class == "user_error" and not d.retry


def test_other_attribute_errors_of_a_cuda_job_stay_user_errors():
    d = diagnose([rep("node-a", "AttributeError: 'GPT' object has no attribute 'blocks'")], device="cuda")
    assert d.failure_class == "user_error"


def test_the_texts_are_this_torch_builds_own():
    torch = pytest.importorskip("torch")
    if torch.backends.cuda.is_built():
        pytest.skip("a CUDA build of torch: the CPU-only texts cannot be produced here")
    seen = []
    for call in (lambda: torch.cuda.set_device(0), lambda: torch.zeros(1, device="cuda")):
        with pytest.raises((AttributeError, AssertionError)) as info:
            call()
        seen.append(f"{type(info.value).__name__}: {info.value}")
    assert seen == NO_CUDA[:2]
