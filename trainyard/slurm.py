"""The Slurm launch backend (`SlurmBackend`, backends.LaunchBackend): sbatch, squeue, sacct,
scontrol and scancel, run on this host or a login node over SSH (trainyard.slurm_runners), for one
pool of the control plane. Pure of Django and torch.

    submit   squeue --name=<tag> first (one job per attempt, whatever the retries), else the batch
             script written under <state_dir>/<tag>/ and `sbatch --parsable`; a request sbatch
             refuses is SubmitRefused, a controller it cannot reach BackendError
    status   one squeue for every handle; those it no longer lists: sacct, or scontrol where
             accounting is off; no answer is UNKNOWN, never ended
    cancel   grace_s > 0: the pool's preempt signal to the steps now (the control plane calls
             cancel(handle, 0) after the grace); 0: scancel
    signal   "checkpoint" / "preempt": the pool's signal to the steps (scancel --signal)
    reconcile  the user's jobs carrying this pool's comment: live tags adopted, orphans cancelled
    unhealthy_nodes  which of a gang's nodes Slurm has DOWN, draining or failing (one sinfo)

Every job carries `--comment=trainyard:<pool>` and `--job-name=<tag>`: only jobs with both are
ever adopted or cancelled.
"""
from __future__ import annotations

import re
from typing import Container, Sequence

from .backends import (BackendError, Capabilities, Gang, Handle, HandleStatus, Reconciled, State, SubmitRefused,
                       parse_tag)
from .slurm_parse import JOB_ID_RE, parse_oneliner, parse_parsable, sbatch_message, sbatch_refusal, to_status
from .slurm_runners import Runner, build_runner
from .slurm_script import SCRIPT_NAME, batch_script, comment, sbatch_argv
from .slurm_settings import SlurmSettings, settings_errors

__all__ = ["SlurmBackend", "SlurmSettings", "settings_errors"]

SEP = "|"
# Job id, state, start (a pending job's expected start), nodes, name, then the reason last (free
# text: split at most 5 times).
STATUS_FORMAT = SEP.join(["%i", "%T", "%S", "%N", "%j", "%r"])
OWN_FORMAT = SEP.join(["%i", "%j", "%T", "%k"])   # the comment last: it is free text
SACCT_FIELDS = "JobIDRaw,State,ExitCode,NodeList,Start"
_INVALID_ID = "invalid job id"
_ALREADY_DONE = ("already completing or completed", _INVALID_ID)
_ACCOUNTING_OFF = "accounting storage is disabled"
_GONE = "not known to Slurm any more"
NODE_FORMAT = SEP.join(["%N", "%T", "%E"])   # node, long state, the reason last (free text)
NODE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# sinfo's long states (lower case, a trailing flag like * stripped) that mean "move off this node".
UNHEALTHY_STATES = ("drain", "down", "fail")   # draining, drained, down, fail, failing


def _err(cmd: str, rc: int, stderr: str) -> str:
    return f"{cmd} failed (rc {rc}): {stderr.strip()[:300] or 'no message'}"


class SlurmBackend:
    capabilities = Capabilities(native_gang=True, requeue=False, suspend=False, elastic=False)

    def __init__(self, pool_name: str, settings: SlurmSettings, runner: Runner | None = None):
        self.pool = pool_name
        self.name = f"slurm:{pool_name}"
        self.settings = settings
        self.runner = runner if runner is not None else build_runner(settings)
        self.comment = comment(pool_name)

    def _run(self, argv: list[str], input: str | None = None) -> tuple[int, str, str]:
        return self.runner.run(argv, timeout=self.settings.command_timeout_s, input=input)

    def _own(self, handle: Handle) -> str:
        if handle.backend != self.name or not JOB_ID_RE.fullmatch(handle.id):
            raise ValueError(f"{handle} is not a job of {self.name}")
        return handle.id

    # -- files ----------------------------------------------------------------------------------

    def put_file(self, tag: str, name: str, data: str) -> str:
        """Write `data` to <state_dir>/<tag>/<name> (directory 0700, file 0600) where the job's
        nodes read it; the path."""
        if parse_tag(tag) is None:
            raise ValueError(f"not an attempt tag: {tag!r}")
        if not name or name.startswith(".") or not all(c.isalnum() or c in "._-" for c in name):
            raise ValueError(f"bad file name {name!r}")
        path = f"{self.settings.job_dir(tag)}/{name}"
        self.runner.write_private(path, data, timeout=self.settings.command_timeout_s)
        return path

    # -- submit ---------------------------------------------------------------------------------

    def _existing(self, tag: str) -> str | None:
        rc, out, err = self._run(["squeue", "--me", "--noheader", "--states=all", f"--name={tag}",
                                  f"--format={OWN_FORMAT}"])
        if rc != 0:
            raise BackendError(_err("squeue", rc, err))
        ids = []
        for line in out.splitlines():
            parts = line.strip().split(SEP, 3)
            if len(parts) == 4 and parts[1] == tag and parts[3] == self.comment and JOB_ID_RE.fullmatch(parts[0]):
                ids.append(parts[0])
        return min(ids, key=int) if ids else None

    def submit(self, gang: Gang) -> Handle:
        tag = gang.tag
        existing = self._existing(tag)
        if existing is not None:
            return Handle(self.name, existing)
        script = batch_script(gang, self.pool)
        argv = sbatch_argv(gang, self.settings, self.pool, f"{self.settings.job_dir(tag)}/{SCRIPT_NAME}")
        self.put_file(tag, SCRIPT_NAME, script)
        rc, out, err = self._run(argv)
        if rc != 0:
            message = sbatch_message(err)
            if sbatch_refusal(err):
                raise SubmitRefused(message)
            raise BackendError(f"sbatch failed (rc {rc}): {message}")
        return Handle(self.name, parse_parsable(out))

    # -- status ---------------------------------------------------------------------------------

    def status(self, handles: Sequence[Handle]) -> dict[Handle, HandleStatus]:
        answer: dict[Handle, HandleStatus] = {}
        by_id: dict[str, list[Handle]] = {}
        for h in handles:
            if h.backend == self.name and JOB_ID_RE.fullmatch(h.id):
                by_id.setdefault(h.id, []).append(h)
            else:
                answer[h] = HandleStatus(State.UNKNOWN, reason=f"not a job of {self.name}")
        found: dict[str, HandleStatus] = {}
        if by_id:
            found = self._lookup(sorted(by_id, key=int))
        for job_id, hs in by_id.items():
            for h in hs:
                answer[h] = found.get(job_id) or HandleStatus(State.UNKNOWN, reason=_GONE)
        return answer

    def _lookup(self, ids: list[str]) -> dict[str, HandleStatus]:
        try:
            found = self._squeue(ids)
        except BackendError as e:
            return {i: HandleStatus(State.UNKNOWN, reason=str(e), source="squeue") for i in ids}
        missing = [i for i in ids if i not in found]
        if missing:
            found.update(self._ended(missing))
        return found

    def _squeue(self, ids: list[str]) -> dict[str, HandleStatus]:
        rc, out, err = self._run(["squeue", "--noheader", "--states=all", f"--jobs={','.join(ids)}",
                                  f"--format={STATUS_FORMAT}"])
        if rc != 0:
            if _INVALID_ID in err.lower():   # every listed id unknown to squeue: none listed
                return {}
            raise BackendError(_err("squeue", rc, err))
        found = {}
        for line in out.splitlines():
            parts = line.strip().split(SEP, 5)
            if len(parts) == 6 and parts[0] in ids:
                job_id, state, start, nodes, _name, reason = parts
                found[job_id] = self._safe(state, reason, nodes, start, source="squeue")
        return found

    @staticmethod
    def _safe(*args: str, source: str) -> HandleStatus:
        try:
            return to_status(*args, source=source)
        except ValueError as e:  # a hostlist this parser cannot read: no answer, not a crash
            return HandleStatus(State.UNKNOWN, reason=f"unreadable Slurm answer: {e}", source=source)

    def _ended(self, ids: list[str]) -> dict[str, HandleStatus]:
        """Jobs squeue no longer lists: sacct, else (accounting off, or sacct silent) scontrol."""
        found: dict[str, HandleStatus] = {}
        try:
            rc, out, err = self._run(["sacct", "--noheader", "--parsable2", "--allocations",
                                      f"--jobs={','.join(ids)}", f"--format={SACCT_FIELDS}"])
        except BackendError as e:
            return {i: HandleStatus(State.UNKNOWN, reason=str(e), source="sacct") for i in ids}
        if rc == 0:
            for line in out.splitlines():   # the last row of a job wins
                parts = line.strip().split(SEP)
                if len(parts) == 5 and parts[0] in ids:
                    job_id, state, code, nodes, start = parts
                    found[job_id] = self._safe(state, "", nodes, start, code, source="sacct")
        elif _ACCOUNTING_OFF not in err.lower():
            failed = _err("sacct", rc, err)
            return {i: HandleStatus(State.UNKNOWN, reason=failed, source="sacct") for i in ids}
        for job_id in ids:
            if job_id not in found:
                found[job_id] = self._scontrol(job_id)
        return found

    def _scontrol(self, job_id: str) -> HandleStatus:
        try:
            rc, out, err = self._run(["scontrol", "show", "job", job_id, "--oneliner"])
        except BackendError as e:
            return HandleStatus(State.UNKNOWN, reason=str(e), source="scontrol")
        if rc != 0:
            if _INVALID_ID in err.lower():
                return HandleStatus(State.UNKNOWN, reason=_GONE, source="scontrol")
            return HandleStatus(State.UNKNOWN, reason=_err("scontrol", rc, err), source="scontrol")
        f = parse_oneliner(out)
        if f.get("JobId") != job_id or "JobState" not in f:
            return HandleStatus(State.UNKNOWN, reason=f"scontrol said nothing of job {job_id}", source="scontrol")
        return self._safe(f["JobState"], f.get("Reason", ""), f.get("NodeList", ""), f.get("StartTime", ""),
                          f.get("ExitCode", ""), source="scontrol")

    # -- cancel, signal -------------------------------------------------------------------------

    def _scancel(self, job_id: str, *options: str) -> None:
        rc, _, err = self._run(["scancel", *options, job_id])
        low = err.lower()
        if rc != 0 and not any(s in low for s in _ALREADY_DONE):
            raise BackendError(_err("scancel", rc, err))

    def cancel(self, handle: Handle, grace_s: float) -> None:
        """grace_s > 0: the preempt signal to the job's steps now (the control plane calls
        cancel(handle, 0) when the grace is over); 0: scancel. A job already ended is no error."""
        job_id = self._own(handle)
        if grace_s > 0:
            self._scancel(job_id, f"--signal={self.settings.preempt_signal}")
        else:
            self._scancel(job_id)

    def signal(self, handle: Handle, sig: str) -> None:
        """"checkpoint" or "preempt": the pool's signal for it, to every step (no --batch, --full)."""
        signals = {"checkpoint": self.settings.checkpoint_signal, "preempt": self.settings.preempt_signal}
        if sig not in signals:
            raise ValueError(f"unknown signal {sig!r} (checkpoint or preempt)")
        self._scancel(self._own(handle), f"--signal={signals[sig]}")

    # -- nodes ----------------------------------------------------------------------------------

    def unhealthy_nodes(self, nodes: Sequence[str]) -> dict[str, tuple[str, str]]:
        """{node: (state, reason)} for those of `nodes` Slurm has DOWN, draining/drained or failing
        (an admin's `scontrol update State=DRAIN`, a health check's verdict): a running gang on one
        of them should move. Slurm lets a job on a draining node run on, and one on a DOWN node is
        killed: the caller checkpoints first where it still can. A node Slurm does not list (or
        only marks not responding, `*`, which its SlurmdTimeout settles) is not reported. One sinfo
        for all; a failed answer raises BackendError."""
        names = sorted({n for n in nodes if NODE_NAME_RE.fullmatch(n)})
        if not names:
            return {}
        rc, out, err = self._run(["sinfo", "--noheader", "--Node", f"--nodes={','.join(names)}",
                                  f"--format={NODE_FORMAT}"])
        if rc != 0:
            raise BackendError(_err("sinfo", rc, err))
        bad: dict[str, tuple[str, str]] = {}
        for line in out.splitlines():
            parts = line.strip().split(SEP, 2)
            if len(parts) < 2 or parts[0] not in names:
                continue
            state = parts[1].strip().lower().rstrip("*~#!%$@^-+")
            if state.startswith(UNHEALTHY_STATES):
                bad[parts[0]] = (state, parts[2].strip() if len(parts) == 3 else "")
        return bad

    # -- reconcile ------------------------------------------------------------------------------

    def reconcile(self, live_tags: Container[str]) -> Reconciled:
        """This user's unended jobs with this pool's comment and a tag for a name: the lowest job id
        of a live tag adopted; orphans (and a live tag's duplicates) cancelled. A cancel that fails
        is left for the next round (not listed); a failed squeue raises BackendError."""
        rc, out, err = self._run(["squeue", "--me", "--noheader", f"--format={OWN_FORMAT}"])
        if rc != 0:
            raise BackendError(_err("squeue", rc, err))
        ours: list[tuple[str, str]] = []
        for line in out.splitlines():
            parts = line.strip().split(SEP, 3)
            if (len(parts) == 4 and parts[3] == self.comment and parse_tag(parts[1]) is not None
                    and JOB_ID_RE.fullmatch(parts[0])):
                ours.append((parts[1], parts[0]))
        adopted: dict[str, Handle] = {}
        orphans = []
        for tag, job_id in sorted(ours, key=lambda t: int(t[1])):
            if tag in live_tags and tag not in adopted:
                adopted[tag] = Handle(self.name, job_id)
            else:
                orphans.append((tag, Handle(self.name, job_id)))
        cancelled = []
        for tag, handle in orphans:
            try:
                self._scancel(handle.id)
            except BackendError:
                continue
            cancelled.append((tag, handle))
        return Reconciled(adopted=tuple(adopted.items()), cancelled=tuple(cancelled))
