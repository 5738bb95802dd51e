"""Map an attempt's evidence to a failure class and a restart decision; hang and straggler
detection (all pure: evidence in, decision out).

Evidence is the agents' exit reports: per node, the exit code/signal of torchrun and the failures
read from the ranks' error files, each with a timestamp, and each rank's last log lines (log_tail:
what a rank that NCCL's watchdog or an asynchronous CUDA error aborted, with no error file, printed
last). The cause is the earliest failure across
nodes: when one rank dies, its peers fail later with "connection closed" errors, which are
consequences, not causes.
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

# Python exceptions that come from the job's own model/data/config code: retrying cannot help.
USER_ERROR_TYPES = ("ValueError", "TypeError", "KeyError", "IndexError", "AttributeError", "NameError",
                    "FileNotFoundError", "AssertionError", "ZeroDivisionError", "ImportError",
                    "ModuleNotFoundError", "NotImplementedError", "SyntaxError",
                    "ConfigError",  # the runtime's own: a spec the data or model cannot satisfy
                    # the node agent's (workers.entrypoint), before launching user code: a `python`
                    # that is missing or cannot run torchrun, a bundle missing or corrupt on the node
                    "EntrypointError", "BundleError")
# GPU failure texts (torch 2.x, the CUDA runtime's cudaGetErrorString, cuBLAS/cuDNN, NCCL), checked in
# this order before the generic COMM_MARKERS: an NCCL or watchdog error often only wraps the CUDA
# error that caused it ("NCCL error ... Cuda failure 'out of memory'", "Process group watchdog thread
# terminated with exception: CUDA error: device-side assert triggered"), and the wrapped error decides.
OOM_MARKERS = ("CUDA out of memory", "OutOfMemoryError", "CUDA error: out of memory", "Cuda failure 'out of memory'",
               "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED", "cudaErrorMemoryAllocation",
               # torch's CPU allocator when the rank's memory (a limit, or the host's) is spent
               "DefaultCPUAllocator: can't allocate memory")
# An out-of-bounds index in the job's own kernels (embedding, loss, index_add_): not retried.
DEVICE_ASSERT_MARKERS = ("device-side assert triggered", "CUDA error: device-side assert", "cudaErrorAssert")
# The GPU or its node failed: retried elsewhere, and it counts toward the node's quarantine.
HARDWARE_MARKERS = ("uncorrectable ECC error", "ECC error", "cudaErrorECCUncorrectable", "unspecified launch failure",
                    "cudaErrorLaunchFailure", "GPU has fallen off the bus", "uncorrectable NVLink error", "Xid")
# CUDA is not there on the node a cuda job's rank ran on (torch 2.x's own texts): a CPU-only torch
# build (`torch._C` lacks the CUDA bindings: "module 'torch._C' has no attribute
# '_cuda_setDevice'" from torch.cuda.set_device, "Torch not compiled with CUDA enabled" from
# torch.cuda._lazy_init), no GPU visible ("No CUDA GPUs are available", c10's device count check),
# no driver or one too old. For a job that asked for cuda this is where it was placed, not its
# code: retried elsewhere, that node excluded. Not counted toward the node's quarantine: a job's
# own `python` with a CPU-only torch says the same on a healthy GPU node. A cpu job that calls
# CUDA anyway is the user's error (it asked for cpu).
NO_CUDA_MARKERS = ("has no attribute '_cuda_setDevice'", "Torch not compiled with CUDA enabled",
                   "No CUDA GPUs are available", "Found no NVIDIA driver on your system",
                   "no CUDA-capable device is detected", "cudaErrorNoDevice",
                   "CUDA driver version is insufficient for CUDA runtime version", "cudaErrorInsufficientDriver",
                   "The NVIDIA driver on your system is too old")
# A rank that NCCL's watchdog aborted (SIGABRT, no error file): its stderr says why.
WATCHDOG_MARKERS = ("Watchdog caught collective operation timeout", "ProcessGroupNCCL's watchdog",
                    "Process group watchdog thread terminated", "NCCL error", "ncclRemoteError", "ncclSystemError")
# A collective that timed out (the process groups' collective_timeout_s, below the hang detector's):
# the rank that reports it waited for a peer that hung or died without a word. It is the hang, seen
# from a healthy rank: retried, and it says nothing against that rank's node.
COLLECTIVE_TIMEOUT_MARKERS = ("Watchdog caught collective operation timeout", "Timed out waiting")
COMM_MARKERS = ("Connection closed by peer", "Connection reset", "Gloo", "NCCL", "timed out", "Timeout",
                "rendezvous", "Rendezvous", "DistNetworkError", "DistStoreError")


# A SIGKILLed rank on a node whose memory use was at least this high was most likely the kernel's
# OOM killer (the kernel says so only in dmesg, which an unprivileged agent cannot read).
OOM_KILL_MEM_PERCENT = 90.0
OOM_SUGGESTION = ("reduce train.global_batch (the per-rank micro-batch) or model size, or enable activation "
                  "recompute; retrying the same configuration would run out of memory again")
# Classes that say something about the node the failing rank ran on (user errors and OOM say
# something about the job). Two of these on one node within the quarantine window quarantine it.
NODE_FAULT_CLASSES = frozenset({"signal", "comm", "lost", "launch_timeout", "unknown", "hardware"})


@dataclass(frozen=True)
class Diagnosis:
    failure_class: str      # user_error | oom | hardware | placement | hang | signal | comm | lost | unknown
    retry: bool
    rank: int | None
    node: str | None
    message: str
    traceback: str = ""
    suggestion: str = ""
    exclude: tuple[str, ...] = ()  # nodes the retry should not use (failed to join the rendezvous)


def first_failure(reports: list[dict]) -> tuple[dict | None, str | None]:
    """Earliest failure across node reports: (failure, node)."""
    best, best_node = None, None
    for rep in reports:
        for f in rep.get("failures") or []:
            if best is None or (f.get("timestamp") or float("inf")) < (best.get("timestamp") or float("inf")):
                best, best_node = f, rep.get("node")
    return best, best_node


def diagnose(reports: list[dict], *, node_lost: str | None = None,
             node_mem_percent: dict[str, float] | None = None, not_joined: tuple[str, ...] = (),
             device: str = "cpu") -> Diagnosis:
    """`node_mem_percent`: each node's memory use at its last heartbeat; `not_joined`: nodes whose
    ranks never started (they failed to join the rendezvous); `device`: the job's
    resources.device (a cuda job's "no CUDA here" is its placement's fault, NO_CUDA_MARKERS)."""
    if node_lost:
        return Diagnosis("lost", True, None, node_lost, f"node {node_lost} stopped sending heartbeats")
    mem = node_mem_percent or {}
    failure, node = first_failure(reports)
    if failure is None:
        codes = [r.get("exit_code") for r in reports if r.get("exit_code") not in (0, None)]
        sig = next((r.get("signal") for r in reports if r.get("signal")), None)
        if sig:
            return Diagnosis("signal", True, None, None, f"torchrun ended by {sig}")
        return Diagnosis("unknown", True, None, None, f"exit codes {codes or 'unknown'} with no error report")
    rank = failure.get("rank")
    text = f"{failure.get('message', '')}\n{failure.get('traceback') or ''}"
    gpu = _gpu_class(text, failure, rank, node)
    if gpu is not None:
        return gpu
    if device == "cuda" and (line := _marker_line(text, NO_CUDA_MARKERS)):
        where = f" on {node}" if node else ""
        return Diagnosis("placement", True, rank, node,
                         f"CUDA is not available{where}: {line} (the job asked for cuda; the retry avoids "
                         f"{node or 'that node'})", failure.get("traceback") or "",
                         suggestion="the node's agent reports GPUs its torch cannot use: check its torch "
                                    "build (torch.version.cuda) and driver",
                         exclude=(node,) if node else ())
    if failure.get("signal"):
        if failure["signal"] == "SIGKILL" and mem.get(node or "", 0.0) >= OOM_KILL_MEM_PERCENT:
            return Diagnosis("oom", False, rank, node,
                             f"rank {rank} was SIGKILLed while {node} used {mem[node]:.0f}% of its memory: "
                             "most likely the kernel's OOM killer", suggestion=OOM_SUGGESTION)
        # No error file: an asynchronous CUDA error or NCCL's watchdog aborted the rank, and only
        # what it printed last says which.
        tail = _rank_tail(reports, node, rank)
        found = _gpu_class("\n".join(tail), failure, rank, node, tail=tail, watchdog=True)
        if found is not None:
            return found
        return Diagnosis("signal", True, rank, node, f"rank {rank} killed by {failure['signal']}",
                         failure.get("traceback") or "")
    exc_type = (failure.get("message") or "").split(":", 1)[0].strip()
    if any(m in text for m in COMM_MARKERS):
        exclude = tuple(not_joined)
        why = f" ({', '.join(exclude)} failed to join; the retry avoids it)" if exclude else ""
        return Diagnosis("comm", True, rank, exclude[0] if exclude else node, failure.get("message", "") + why,
                         failure.get("traceback", ""), exclude=exclude)
    if exc_type.endswith(USER_ERROR_TYPES) or any(f"{t}:" in text for t in USER_ERROR_TYPES):
        return Diagnosis("user_error", False, rank, node, failure.get("message", ""), failure.get("traceback", ""))
    return Diagnosis("unknown", True, rank, node, failure.get("message", ""), failure.get("traceback", ""))


def _rank_tail(reports: list[dict], node: str | None, rank: int | None) -> list[str]:
    """The failed rank's last stdout/stderr lines from its node's report (NodeExit.log_tail)."""
    rep = next((r for r in reports if r.get("node") == node), {})
    return list((rep.get("log_tail") or {}).get(str(rank)) or [])


def _marker_line(text: str, markers: tuple[str, ...]) -> str | None:
    """The first line of `text` holding one of `markers` ("Xid" only as a word), or None."""
    for line in text.splitlines():
        for m in markers:
            if (re.search(r"\bXid\b", line) if m == "Xid" else m in line):
                return line.strip()
    return None


def _gpu_class(text: str, failure: dict, rank, node, *, tail: list[str] | None = None,
               watchdog: bool = False) -> Diagnosis | None:
    """OOM, a device-side assert or a hardware fault named in `text`, in that order; with
    `watchdog` (a rank's log tail), also NCCL's watchdog. None when it names none of them."""
    where = f"rank {rank} killed by {failure.get('signal')}: " if tail is not None else ""
    tb = "\n".join(tail) if tail is not None else failure.get("traceback") or ""
    msg = failure.get("message", "")
    if line := _marker_line(text, OOM_MARKERS):
        return Diagnosis("oom", False, rank, node, where + line if where else msg, tb, suggestion=OOM_SUGGESTION)
    if line := _marker_line(text, DEVICE_ASSERT_MARKERS):
        return Diagnosis("user_error", False, rank, node, where + line if where else msg, tb,
                         suggestion="a CUDA kernel's assert (often an index out of range, e.g. a token id >= "
                                    "the vocabulary): rerun with CUDA_LAUNCH_BLOCKING=1 to see where")
    if line := _marker_line(text, HARDWARE_MARKERS):
        excl = (node,) if node else ()
        return Diagnosis("hardware", True, rank, node, (where + line if where else msg) +
                         (f" (a GPU fault on {node}; the retry avoids it)" if node else ""), tb, exclude=excl)
    if line := _marker_line(text, COLLECTIVE_TIMEOUT_MARKERS):
        return Diagnosis("hang", True, None, None, f"{where or f'rank {rank}: '}timed out waiting in a "
                         f"collective, for a peer that hung or died before joining it ({line})", tb)
    if watchdog and (line := _marker_line(text, WATCHDOG_MARKERS)):
        return Diagnosis("comm", True, rank, node, where + line, tb)
    return None


# ---------------------------------------------------------------- hangs

HANG_FACTOR = 10  # a step 10x slower than the recent median is no longer "slow", it is stuck
STARTUP_GRACE_S = 180.0  # before the first step: imports, data, rendezvous and checkpoint load


@dataclass(frozen=True)
class HangCheck:
    hung: bool
    timeout_s: float
    source: str  # "spec" | "auto"
    idle_s: float


def hang_timeout(spec_timeout: float | str | None, recent_step_s: list[float], floor_s: float) -> tuple[float, str]:
    """The seconds without step progress after which an attempt counts as hung. "auto": HANG_FACTOR
    times the median recent step time (`recent_step_s`: each of the last steps' mean across ranks,
    selectors.attempt_recent_step_s), never under floor_s (a checkpoint save or an eval can
    legitimately pause progress for a while)."""
    if isinstance(spec_timeout, (int, float)) and not isinstance(spec_timeout, bool):
        return float(spec_timeout), "spec"
    median = statistics.median(recent_step_s) if recent_step_s else 0.0
    return max(floor_s, HANG_FACTOR * median), "auto"


COLLECTIVE_TIMEOUT_FRACTION = 0.8  # of the shortest hang timeout the detector can apply
# What must fit between a collective's timeout and the hang verdict: torchrun tears the peers down
# (workers.launch_spec.SHUTDOWN_TIMEOUT_S, 5 s), the agent reports the exit, the detector ticks.
COLLECTIVE_REPORT_MARGIN_S = 15.0
MIN_COLLECTIVE_TIMEOUT_S = 10.0  # shorter would fail slow but healthy collectives (a first NCCL call)


def collective_timeout(spec_timeout: float | str | None, floor_s: float) -> float | None:
    """The timeout the ranks give every process group (init_process_group, new_group): under
    the shortest hang timeout this job can get (its number, or the auto floor) by enough for the
    failure to be reported first, so that a collective stuck on a dead or missing peer fails its
    rank with torch's timeout error (and, on NCCL, a flight-recorder dump) instead of racing the
    hang verdict. None (torch's defaults; the detector, with every rank's stack, handles a hang)
    when the hang timeout is too short to hold that margin above MIN_COLLECTIVE_TIMEOUT_S."""
    hang = hang_timeout(spec_timeout, [], floor_s)[0]
    timeout = min(COLLECTIVE_TIMEOUT_FRACTION * hang, hang - COLLECTIVE_REPORT_MARGIN_S)
    return round(timeout, 3) if timeout >= MIN_COLLECTIVE_TIMEOUT_S else None


def hang_armed(spec_timeout, *, user_code: bool, last_progress: float | None) -> bool:
    """Whether the hang detector judges this attempt now. An entrypoint job (user code) with
    hang_timeout_s auto is judged only from its first reported step: a script without the SDK
    never reports one and would otherwise be killed STARTUP_GRACE_S into every attempt, and an
    auto timeout needs step times anyway. A number is the user's explicit choice and applies from
    the start, as for the built-in trainer (for a script without the SDK it bounds each attempt)."""
    return not (user_code and last_progress is None and hang_timeout(spec_timeout, [], 0.0)[1] == "auto")


def hang_check(*, now: float, started: float, last_progress: float | None, spec_timeout, recent_step_s: list[float],
               floor_s: float, user_code: bool = False) -> HangCheck:
    """`started`/`last_progress`/`now` in epoch seconds. Before the first step the timeout is at
    least STARTUP_GRACE_S; an attempt `hang_armed` says not to judge is never hung (timeout inf)."""
    timeout, source = hang_timeout(spec_timeout, recent_step_s, floor_s)
    idle = now - (last_progress if last_progress is not None else started)
    if not hang_armed(spec_timeout, user_code=user_code, last_progress=last_progress):
        return HangCheck(False, float("inf"), source, idle)
    if last_progress is None:
        timeout = max(timeout, STARTUP_GRACE_S)
    idle = now - (last_progress if last_progress is not None else started)
    return HangCheck(idle > timeout, timeout, source, idle)


# ---------------------------------------------------------------- stragglers

STRAGGLER_RATIO = 1.20   # flagged above 20% slower than its peers' median
STRAGGLER_CLEAR = 1.10   # cleared below 10%: the gap stops flapping a rank near the threshold
STRAGGLER_MIN_STEPS = 10  # "persistently": a median over at least this many of its recent steps
# ...and by at least this much: on a shared 2-core machine, CPU ranks of ~20 ms steps drift 5 ms
# (25%) apart from scheduler noise alone; a real straggler is slower by a lot more than that.
STRAGGLER_MIN_EXCESS_S = 0.010


@dataclass(frozen=True)
class Straggler:
    rank: int
    ratio: float
    work_s: float
    median_s: float


def stragglers(work_s: dict[int, list[float]], flagged: frozenset[int] = frozenset()) -> list[Straggler]:
    """Ranks whose own work per step (data + compute + optimizer: time not spent waiting for peers
    in collectives) is persistently above the median of the other ranks of the job. In synchronous
    data parallel every rank's step_s is the same (everyone waits for the slowest), so step_s itself
    cannot name the straggler; the wait moves into its peers' comm time. `flagged`: ranks flagged
    now, which stay flagged until they drop under STRAGGLER_CLEAR."""
    per_rank = {r: statistics.median(v) for r, v in work_s.items() if len(v) >= STRAGGLER_MIN_STEPS}
    if len(per_rank) < 2:
        return []
    out = []
    for rank, mine in sorted(per_rank.items()):
        peers = statistics.median(v for r, v in per_rank.items() if r != rank)
        if peers <= 0:
            continue
        ratio = mine / peers
        if mine - peers < STRAGGLER_MIN_EXCESS_S:
            continue
        if ratio > STRAGGLER_RATIO or (rank in flagged and ratio > STRAGGLER_CLEAR):
            out.append(Straggler(rank, round(ratio, 3), mine, peers))
    return out
