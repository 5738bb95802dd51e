"""Map an attempt's exit evidence to a failure class and a restart decision (pure).

Evidence is the agents' exit reports: per node, the exit code/signal of torchrun and the failures
read from the ranks' error files, each with a timestamp. The cause is the earliest failure across
nodes: when one rank dies, its peers fail later with "connection closed" errors, which are
consequences, not causes.
"""
from __future__ import annotations

from dataclasses import dataclass

# Python exceptions that come from the job's own model/data/config code: retrying cannot help.
USER_ERROR_TYPES = ("ValueError", "TypeError", "KeyError", "IndexError", "AttributeError", "NameError",
                    "FileNotFoundError", "AssertionError", "ZeroDivisionError", "ImportError",
                    "ModuleNotFoundError", "NotImplementedError", "SyntaxError",
                    "ConfigError")  # the runtime's own: a spec the data or model cannot satisfy
COMM_MARKERS = ("Connection closed by peer", "Connection reset", "Gloo", "NCCL", "timed out", "Timeout",
                "rendezvous", "Rendezvous", "DistNetworkError", "DistStoreError")


@dataclass(frozen=True)
class Diagnosis:
    failure_class: str      # user_error | oom | signal | comm | lost | unknown
    retry: bool
    rank: int | None
    node: str | None
    message: str
    traceback: str = ""


def first_failure(reports: list[dict]) -> tuple[dict | None, str | None]:
    """Earliest failure across node reports: (failure, node)."""
    best, best_node = None, None
    for rep in reports:
        for f in rep.get("failures") or []:
            if best is None or (f.get("timestamp") or float("inf")) < (best.get("timestamp") or float("inf")):
                best, best_node = f, rep.get("node")
    return best, best_node


def diagnose(reports: list[dict], *, node_lost: str | None = None) -> Diagnosis:
    if node_lost:
        return Diagnosis("lost", True, None, node_lost, f"node {node_lost} stopped sending heartbeats")
    failure, node = first_failure(reports)
    if failure is None:
        codes = [r.get("exit_code") for r in reports if r.get("exit_code") not in (0, None)]
        sig = next((r.get("signal") for r in reports if r.get("signal")), None)
        if sig:
            return Diagnosis("signal", True, None, None, f"torchrun ended by {sig}")
        return Diagnosis("unknown", True, None, None, f"exit codes {codes or 'unknown'} with no error report")
    text = f"{failure.get('message', '')}\n{failure.get('traceback', '')}"
    rank = failure.get("rank")
    if "CUDA out of memory" in text or "OutOfMemoryError" in text:
        return Diagnosis("oom", False, rank, node, failure.get("message", ""), failure.get("traceback", ""))
    if failure.get("signal"):
        return Diagnosis("signal", True, rank, node, f"rank {rank} killed by {failure['signal']}",
                         failure.get("traceback", ""))
    exc_type = (failure.get("message") or "").split(":", 1)[0].strip()
    if any(m in text for m in COMM_MARKERS):
        return Diagnosis("comm", True, rank, node, failure.get("message", ""), failure.get("traceback", ""))
    if exc_type.endswith(USER_ERROR_TYPES) or any(f"{t}:" in text for t in USER_ERROR_TYPES):
        return Diagnosis("user_error", False, rank, node, failure.get("message", ""), failure.get("traceback", ""))
    return Diagnosis("unknown", True, rank, node, failure.get("message", ""), failure.get("traceback", ""))
