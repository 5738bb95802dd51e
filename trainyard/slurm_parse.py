"""What the Slurm CLI prints, read into the launch-backend interface's terms: job states and
pending reasons (`to_status`, `pending_category`), compressed hostlists (`expand_hostlist`),
times, exit codes, `scontrol --oneliner` records, sbatch's `--parsable` id and its errors
(`sbatch_refusal`). Pure: no I/O, no processes.
"""
from __future__ import annotations

import re
import time

from .backends import BackendError, HandleStatus, State

JOB_ID_RE = re.compile(r"[0-9]{1,12}")

_PENDING = {"PENDING": "", "CONFIGURING": "resources"}
_HELD = frozenset({"REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SPECIAL_EXIT"})
# SUSPENDED and STOPPED still hold the nodes (the processes are paused, not gone): RUNNING, the
# state name in the reason, so the control plane never reads a paused gang as ended.
_RUNNING = frozenset({"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING", "SUSPENDED", "STOPPED"})
_FAILED = frozenset({"FAILED", "OUT_OF_MEMORY", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE"})
_ENDED = {"COMPLETED": State.SUCCEEDED, "PREEMPTED": State.PREEMPTED, "CANCELLED": State.CANCELLED,
          "REVOKED": State.CANCELLED}

# Pending reasons (squeue's %r, scontrol's Reason=) by category, first match wins.
_CATEGORY_RULES: tuple[tuple[str, re.Pattern], ...] = (
    ("held", re.compile(r"JobHeld(User|Admin)|Held.*|.*Hold|launch failed requeued held")),
    ("dependency", re.compile(r"Dependency(NeverSatisfied)?")),
    ("priority", re.compile(r"Priority")),
    ("limits", re.compile(r"QOS.*Limit.*|QOS(Grp|Max|Min).*|Assoc(Grp|Max).*|.*TimeLimit|PartitionNodeLimit|MaxJobsPerUser.*"
                          r"|JobArrayTaskLimit|.*MinCPUs|.*Max.*PerAccount.*|QOSUsageThreshold")),
    ("resources", re.compile(r"Resources|Nodes required for job.*|ReqNodeNotAvail.*|BeginTime|NodeDown"
                             r"|Licenses|Reservation|PartitionConfig|Cleaning|Prolog|BurstBufferResources.*")),
)


def pending_category(reason: str) -> str:
    """The PENDING_CATEGORIES entry of a Slurm pending reason ("other" when unrecognised)."""
    reason = reason.strip()
    for category, rule in _CATEGORY_RULES:
        if rule.fullmatch(reason):
            return category
    return "other"


def _segment(text: str) -> list[str]:
    """One bracket expression's items: "1-3,07,9-10" -> ["1", "2", "3", "07", "9", "10"], with the
    zero padding of each range's start kept."""
    out = []
    for part in text.split(","):
        lo, dash, hi = part.partition("-")
        if not dash:
            out.append(lo)
            continue
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo) or int(hi) - int(lo) > 100_000:
            raise ValueError(f"bad hostlist range {part!r}")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def _expand_one(name: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", name)
    if not m:
        return [name]
    head, tail = name[:m.start()], name[m.end():]
    return [head + item + rest for item in _segment(m.group(1)) for rest in _expand_one(tail)]


def expand_hostlist(text: str) -> tuple[str, ...]:
    """Slurm's compressed hostlist as names: "gpu-[1-2,4]" -> gpu-1 gpu-2 gpu-4, "n[01-03]" keeps
    the padding, "a,b" two names, "r[1-2]-n[1-2]" the product; "", "(null)", "N/A" -> ()."""
    text = text.strip()
    if text in ("", "(null)", "N/A", "None"):
        return ()
    names, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            if text[start:i]:
                names.extend(_expand_one(text[start:i]))
            start = i + 1
        if depth < 0 or depth > 1:
            raise ValueError(f"unbalanced brackets in hostlist {text!r}")
    if depth:
        raise ValueError(f"unbalanced brackets in hostlist {text!r}")
    return tuple(names)


def format_time_limit(seconds: int) -> str:
    """sbatch's --time as D-HH:MM:SS (Slurm rounds up to a whole minute)."""
    days, rest = divmod(int(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"


def parse_start(text: str) -> float | None:
    """squeue's %S / scontrol's StartTime ("2024-05-01T12:00:00") as epoch seconds, None when it is
    no real time ("N/A", "Unknown", "None"). Slurm prints the controller's local time without a zone:
    this reads it in this process's local zone, so both hosts must share a zone (servers: UTC)."""
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except (ValueError, OverflowError):
        return None


def parse_exit_code(text: str) -> int | None:
    """Slurm's "code:signal": the code, or 128 + signal for a job a signal ended (code 0)."""
    code, _, sig = text.strip().partition(":")
    if not code.isdigit():
        return None
    if int(code) == 0 and sig.isdigit() and int(sig):
        return 128 + int(sig)
    return int(code)


def parse_oneliner(text: str) -> dict[str, str]:
    """`scontrol show job <id> --oneliner` as {key: value} (values up to the next space)."""
    return dict(re.findall(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=(\S*)", text.strip()))


def parse_parsable(out: str) -> str:
    """The job id of `sbatch --parsable`'s answer: "123" or "123;cluster"."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    job_id = lines[-1].split(";", 1)[0] if lines else ""
    if not JOB_ID_RE.fullmatch(job_id):
        raise BackendError(f"sbatch printed no job id: {out.strip()[:200]!r}")
    return job_id


def to_status(state: str, reason: str = "", nodes: str = "", start: str = "", exit_code: str = "",
              source: str = "") -> HandleStatus:
    """One job's HandleStatus from Slurm's own words (squeue, sacct or scontrol)."""
    name = (state.split() or [""])[0].rstrip("+").upper()  # sacct: "CANCELLED by 1000"
    reason = "" if reason.strip() in ("None", "(null)") else reason.strip()
    code = parse_exit_code(exit_code) if exit_code else None
    if name in _PENDING or name in _HELD:
        category = "held" if name in _HELD else (_PENDING[name] or pending_category(reason))
        words = reason if name == "PENDING" else f"{name}: {reason}" if reason else name
        return HandleStatus(State.PENDING, reason=words, category=category, eta=parse_start(start), source=source)
    if name in _RUNNING:
        words = name if name in ("SUSPENDED", "STOPPED") else ""
        return HandleStatus(State.RUNNING, reason=words, nodes=expand_hostlist(nodes), source=source)
    if name in _FAILED:
        return HandleStatus(State.FAILED, reason=f"{name}: {reason}" if reason else name, exit_code=code,
                            source=source)
    if name in _ENDED:
        return HandleStatus(_ENDED[name], reason=reason, exit_code=code, source=source)
    return HandleStatus(State.UNKNOWN, reason=f"unrecognised Slurm state {state!r}", source=source)


# sbatch's refusals of the request itself (the attempt fails) and its transient failures (retry).
_TRANSIENT = re.compile(r"unable to contact slurm controller|socket timed out|connection refused|timed out"
                        r"|temporarily unable|zero bytes were transmitted|slurm_persist_conn|communication"
                        r"|connection reset|no route to host|name or service not known|resource temporarily",
                        re.I)
_REFUSED = re.compile(r"invalid (partition|account|qos|generic resource|gres|feature|reservation|license"
                      r"|node name|nodelist|--\w|\w+ specification)|requested node configuration is not available"
                      r"|more processors requested than permitted|job violates accounting/qos policy"
                      r"|node count specification invalid|requested time limit is invalid"
                      r"|requested partition configuration not available|memory specification can not be satisfied"
                      r"|not permitted to use this partition|access denied|invalid account or account/partition"
                      r"|requested reservation is invalid|unrecognized option|invalid argument", re.I)


def sbatch_message(stderr: str) -> str:
    """sbatch's error lines without the "sbatch: error: " prefixes, one line, at most 500 characters."""
    lines = [re.sub(r"^(sbatch: )?(error: )?", "", ln.strip()) for ln in stderr.splitlines() if ln.strip()]
    return " ".join(lines)[:500] or "sbatch failed without a message"


def sbatch_refusal(stderr: str) -> bool:
    """True when sbatch refused the request itself; False when the failure may pass (retry)."""
    return not _TRANSIENT.search(stderr) and bool(_REFUSED.search(stderr))
