"""Failure classes on GPUs, table-driven with the texts torch 2.x, the CUDA runtime, cuBLAS and NCCL
print: OOM before comm (an NCCL error that wraps a CUDA OOM is an OOM), and a rank that NCCL's
watchdog or an asynchronous CUDA error aborted (SIGABRT, no error file) classified from its log tail."""
import pytest

from jobs.attempts.policy.diagnosis import NODE_FAULT_CLASSES, diagnose

ASYNC = ("CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
         "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
         "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.")


def recorded(rank, ts, message, tb="Traceback (most recent call last): ..."):
    """A failure read from the rank's @record error file."""
    return {"rank": rank, "timestamp": ts, "message": message, "traceback": tb, "signal": None}


def aborted(rank, ts):
    """A rank torchrun saw die of SIGABRT, without an error file (launcher_logs.collect_failures)."""
    return {"rank": rank, "timestamp": ts, "message": "Signal 6 (SIGABRT) received by PID 4242", "traceback": None,
            "signal": "SIGABRT", "exitcode": -6}


def rep(node, *failures, tails=None):
    return {"node": node, "exit_code": 1, "signal": None, "failures": list(failures),
            "log_tail": {str(r): lines for r, lines in (tails or {}).items()}}


NCCL_WRAPPED_OOM = ("torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/"
                    "ProcessGroupNCCL.cpp:3356, unhandled cuda error (run with NCCL_DEBUG=INFO for details), "
                    "NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n"
                    "Cuda failure 'out of memory'")
WATCHDOG_TAIL = [
    "[rank1]:[E1201 17:00:00.123456 1234 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran for "
    "600035 milliseconds before timing out.",
    "[rank1]:[E1201 17:00:00.123789 1234 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank 1] Timeout "
    "at NCCL work: 42, last enqueued NCCL work: 42, last completed NCCL work: 41.",
    "[rank1]:[E1201 17:00:00.123800 1234 ProcessGroupNCCL.cpp:630] [Rank 1] To avoid data inconsistency, we are "
    "taking the entire process down.",
    "terminate called after throwing an instance of 'c10::DistBackendError'",
]
STUCK_WATCHDOG_TAIL = [
    "[rank0]:[E1201 17:08:00.000001 77 ProcessGroupNCCL.cpp:1423] [PG ID 0 PG GUID 0(default_pg) Rank 0] "
    "ProcessGroupNCCL's watchdog got stuck for 480 seconds without making progress in monitoring enqueued "
    "collectives. This typically indicates a NCCL/CUDA API hang blocking the watchdog, and could be triggered by "
    "another thread holding the GIL inside a CUDA api, or other deadlock-prone behaviors.",
]
ASSERT_TAIL = [
    "/pytorch/aten/src/ATen/native/cuda/Indexing.cu:1289: indexSelectLargeIndex: block: [0,0,0], thread: [0,0,0] "
    "Assertion `srcIndex < srcSelectDimSize` failed.",
    "terminate called after throwing an instance of 'c10::DistBackendError'",
    "  what():  [PG ID 0 PG GUID 0(default_pg) Rank 0] Process group watchdog thread terminated with exception: "
    "CUDA error: device-side assert triggered",
    *ASYNC.splitlines(),
]
ECC_TAIL = ["terminate called after throwing an instance of 'c10::Error'",
            "  what():  CUDA error: uncorrectable ECC error encountered", *ASYNC.splitlines()]
LAUNCH_FAILURE_TAIL = [
    "terminate called after throwing an instance of 'c10::DistBackendError'",
    "  what():  [PG ID 0 PG GUID 0(default_pg) Rank 0] Process group watchdog thread terminated with exception: "
    "CUDA error: unspecified launch failure", *ASYNC.splitlines()]
XID_TAIL = ["NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."]
WATCHDOG_OOM_TAIL = [
    "  what():  [PG ID 0 PG GUID 0(default_pg) Rank 0] Process group watchdog thread terminated with exception: "
    "CUDA error: out of memory", *ASYNC.splitlines()]
NCCL_INFO_TAIL = ["node-a:4242:4300 [0] NCCL INFO Channel 00/02 :    0   1",
                  "node-a:4242:4300 [0] NCCL INFO Connected all rings"]

CASES = [
    # desc, reports, class, retry, rank, node, exclude
    ("an OOM wrapped in an NCCL error is oom, not comm", [rep("a", recorded(0, 1.0, NCCL_WRAPPED_OOM))],
     "oom", False, 0, "a", ()),
    ("CUDA error: out of memory (the runtime's, not the caching allocator's)",
     [rep("a", recorded(1, 1.0, "RuntimeError: CUDA error: out of memory\n" + ASYNC))], "oom", False, 1, "a", ()),
    ("cuBLAS failing to allocate its workspace",
     [rep("a", recorded(0, 1.0, "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                                "`cublasCreate(handle)`"))], "oom", False, 0, "a", ()),
    ("torch.OutOfMemoryError", [rep("a", recorded(0, 1.0, "torch.OutOfMemoryError: CUDA out of memory. Tried to "
                                                          "allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB "
                                                          "of which 6.75 MiB is free."))], "oom", False, 0, "a", ()),
    ("torch.cuda.OutOfMemoryError raised inside an NCCL collective",
     [rep("a", recorded(0, 1.0, "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB",
                        tb="File \"torch/distributed/distributed_c10d.py\", in all_reduce\n  NCCL ..."))],
     "oom", False, 0, "a", ()),
    ("a synchronous device-side assert from an error file is the user's",
     [rep("a", recorded(0, 1.0, "RuntimeError: CUDA error: device-side assert triggered\n" + ASYNC))],
     "user_error", False, 0, "a", ()),
    # A collective timeout (now under the hang detector's, finding 5) is the hang seen from a rank
    # that waited for a stuck peer: retried, and nothing against the waiting rank's node.
    ("SIGABRT by NCCL's watchdog timeout: the hang, not the waiting node's fault",
     [rep("a", aborted(0, 9.0), tails={0: WATCHDOG_TAIL}), rep("b", aborted(1, 3.0), tails={1: WATCHDOG_TAIL})],
     "hang", True, None, None, ()),
    ("SIGABRT by a stuck ProcessGroupNCCL watchdog", [rep("a", aborted(0, 1.0), tails={0: STUCK_WATCHDOG_TAIL})],
     "comm", True, 0, "a", ()),
    ("SIGABRT by a device-side assert the watchdog reported: the user's, not comm",
     [rep("a", aborted(0, 1.0), tails={0: ASSERT_TAIL})], "user_error", False, 0, "a", ()),
    ("SIGABRT by an uncorrectable ECC error: the node's, retried elsewhere",
     [rep("a", aborted(0, 5.0), tails={0: WATCHDOG_TAIL}), rep("b", aborted(1, 2.0), tails={1: ECC_TAIL})],
     "hardware", True, 1, "b", ("b",)),
    ("SIGABRT by an unspecified launch failure the watchdog reported: hardware, not comm",
     [rep("a", aborted(0, 1.0), tails={0: LAUNCH_FAILURE_TAIL})], "hardware", True, 0, "a", ("a",)),
    ("an Xid in the rank's log", [rep("a", aborted(0, 1.0), tails={0: XID_TAIL})], "hardware", True, 0, "a", ("a",)),
    ("SIGABRT by a CUDA OOM the watchdog reported: oom, not comm",
     [rep("a", aborted(0, 1.0), tails={0: WATCHDOG_OOM_TAIL})], "oom", False, 0, "a", ()),
    ("SIGABRT with only NCCL INFO lines stays a signal", [rep("a", aborted(0, 1.0), tails={0: NCCL_INFO_TAIL})],
     "signal", True, 0, "a", ()),
    ("SIGABRT with no log tail stays a signal", [rep("a", aborted(0, 1.0))], "signal", True, 0, "a", ()),
    ("a plain NCCL error is still comm",
     [rep("a", recorded(0, 1.0, "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
                                "remote process exited or there was a network error, NCCL version 2.21.5"))],
     "comm", True, 0, "a", ()),
]


@pytest.mark.parametrize("desc,reports,cls,retry,rank,node,exclude", CASES, ids=[c[0] for c in CASES])
def test_gpu_failure_classes(desc, reports, cls, retry, rank, node, exclude):
    d = diagnose(reports)
    assert (d.failure_class, d.retry, d.rank, d.node, d.exclude) == (cls, retry, rank, node, exclude)
    if cls == "oom":
        assert "micro-batch" in d.suggestion
    if reports[0]["log_tail"] and cls != "signal":  # the line that decided is in the message
        assert "SIGABRT" in d.message and len(d.message) > len("rank 0 killed by SIGABRT: ")


def test_a_gpu_fault_counts_toward_the_nodes_quarantine_and_an_assert_does_not():
    assert "hardware" in NODE_FAULT_CLASSES
    assert {"oom", "user_error"}.isdisjoint(NODE_FAULT_CLASSES)
