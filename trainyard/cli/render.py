"""Tables and key/value views for `ls`, `show`, `checkpoints`, `nodes` and `plan` (rich).

Every cell is a rich Text of `safe.clean(value)` (`_row`): job names, failure messages, labels and
paths are other people's (or their jobs') text, printed literally: no control sequence reaches the
terminal, and `[...]` / `:emoji:` in them are not read as rich markup."""
from __future__ import annotations

from rich.table import Table

from .safe import text


def _row(table: Table, *cells) -> None:
    table.add_row(*(text(c) for c in cells))


def _when(value: str | None) -> str:
    return (value or "")[:19].replace("T", " ")


def _steps(job: dict) -> str:
    return f"{job.get('step') or 0}/{job.get('total_steps') or '?'}"


def _size(n: int | None) -> str:
    if n is None:
        return ""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def jobs_table(jobs: list[dict]) -> Table:
    t = Table(box=None, header_style="bold")
    for col in ("ID", "NAME", "STATUS", "OWNER", "STEP", "RESTARTS", "CREATED", "TAGS"):
        t.add_column(col, no_wrap=col not in ("NAME", "TAGS"))
    for j in jobs:
        _row(t, str(j["id"]), j.get("name", ""), j.get("status", ""), j.get("owner", ""), _steps(j),
                str(j.get("restarts", 0)), _when(j.get("created_at")), ",".join(j.get("tags") or []))
    return t


def job_view(job: dict) -> list:
    """A job's fields, then one row per attempt."""
    spec = job.get("spec") or {}
    entry = spec.get("entrypoint") or {}
    what = (entry.get("script") or entry.get("module") or "") if entry else (spec.get("model") or {}).get("kind", "")
    fields = Table.grid(padding=(0, 2))
    fields.add_column(style="bold", no_wrap=True)
    fields.add_column(overflow="fold")  # a digest or a reason is shown whole, wrapped
    rows = [("job", f"{job['id']} {job.get('name', '')}"), ("status", job.get("status", "")),
            ("reason", job.get("status_reason") or ""), ("owner", job.get("owner", "")),
            ("runs", what), ("code", ((spec.get("code") or {}).get("bundle") or "")),
            ("step", _steps(job)), ("restarts", str(job.get("restarts", 0))),
            ("queue position", str(job.get("queue_position") or "")),
            ("created", _when(job.get("created_at"))), ("started", _when(job.get("started_at"))),
            ("finished", _when(job.get("finished_at")))]
    for key, value in rows:
        if value:
            _row(fields, key, value)
    attempts = Table(box=None, header_style="bold", title="attempts", title_justify="left")
    for col in ("#", "ID", "STATUS", "OUTCOME", "LAST STEP", "RANKS", "FAILURE"):
        attempts.add_column(col)
    for a in job.get("attempts") or []:
        failure = a.get("failure") or {}
        why = failure.get("message") or failure.get("class") or "" if isinstance(failure, dict) else str(failure)
        nodes = sorted({r.get("node", "") for r in a.get("ranks") or []})
        slurm = a.get("slurm") or {}
        if slurm and not why:  # on a Slurm pool: its Slurm job, and why it waits while Slurm pends
            why = f"Slurm job {slurm.get('job_id') or '?'} {slurm.get('state', '')}" + (
                f": {slurm.get('category')} ({slurm.get('reason')})" if slurm.get("state") == "pending" else "")
        _row(attempts, str(a.get("number")), str(a.get("id")), a.get("status", ""), a.get("outcome") or "",
                       str(a.get("last_step") or 0), f"{len(a.get('ranks') or [])} on {','.join(nodes)}", why)
    return [fields, attempts] if job.get("attempts") else [fields]


def checkpoints_table(rows: list[dict]) -> Table:
    t = Table(box=None, header_style="bold")
    for col in ("ID", "STEP", "ATTEMPT", "CREATED", "SIZE", "STATE", "PATH"):
        t.add_column(col, overflow="fold" if col == "PATH" else "ellipsis", no_wrap=col != "PATH")
    for c in rows:
        state = ("deleted" if c.get("deleted") else "pinned" if c.get("pinned")
                 else "superseded" if c.get("superseded") else "kept")
        _row(t, str(c["id"]), str(c.get("step")), str(c.get("attempt") or ""), _when(c.get("created_at")),
                _size(c.get("size_bytes")), state, c.get("path") or "")
    return t


def nodes_table(nodes: list[dict]) -> Table:
    t = Table(box=None, header_style="bold")
    for col in ("NAME", "STATUS", "SLOTS", "ADDRESS", "CPU", "MEM", "DEVICES", "LABELS"):
        t.add_column(col)
    for n in nodes:
        pct = lambda v: "" if v is None else f"{v:.0f}%"  # noqa: E731
        labels = ",".join(f"{k}={v}" for k, v in sorted((n.get("labels") or {}).items()))
        _row(t, n["name"], n.get("status", "") + (f" ({n['drain_mode']})" if n.get("drain_mode") else ""),
                f"{n.get('slots_used', 0)}/{n.get('slots', 0)}", n.get("address", ""), pct(n.get("cpu_percent")),
                pct(n.get("mem_percent")), str(len(n.get("devices") or [])), labels)
    return t


def _layout(p: dict) -> str:
    sharding = "fsdp" if p.get("fsdp") else "zero-1" if p.get("shard_optimizer") else "ddp"
    return f"dp {p['dp']} x tp {p['tp']} x pp {p['pp']} ({sharding})"


def plans_view(result: dict, top: int) -> list:
    """The best `top` plans as a table, the best one's explanation, and the rejected count."""
    plans, rejected = result.get("plans") or [], result.get("rejected") or []
    if not plans:
        nearest = rejected[0]["reason"] if rejected else "no layout divides the cluster and the batch"
        return [f"no plan fits: nearest miss {_layout(rejected[0]) + ': ' if rejected else ''}{nearest}"]
    t = Table(box=None, header_style="bold")
    for col in ("#", "LAYOUT", "MICRO-BATCH", "RECOMPUTE", "SCHEDULE", "STEP", "TFLOP/S", "MEMORY", "BUBBLE"):
        t.add_column(col, no_wrap=True)
    for i, p in enumerate(plans[:top], 1):
        _row(t, str(i), _layout(p), str(p["micro_batch"]), p["recompute"], p.get("schedule") or "",
                f"{p['step_time_s']:.3g} s", f"{p['tflops_per_device']:.3g}", f"{p['memory_gb_per_device']:.1f} GB",
                f"{p['bubble_fraction']:.0%}")
    return [t, f"best: {plans[0]['explain']}",
            f"{len(plans)} plans fit ({min(top, len(plans))} shown); {len(rejected)} rejected listed"
            + (f", nearest: {rejected[0]['reason']}" if rejected else "")]
