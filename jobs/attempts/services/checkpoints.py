"""The checkpoint registry: registration (reported or found on disk), retention, resume point, pin.

A checkpoint is a directory `<TRAINYARD_CHECKPOINT_ROOT>/job-<id>/step-<n>/` that rank 0 renames
into place after writing its manifest `trainyard.json`; registration only accepts paths under the
job's own directory, and deletion only ever touches paths under the root. Which checkpoints to
keep, resume from or supersede is jobs/attempts/policy/checkpoints.py's decision.
"""
from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
import stat
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from trainyard import attemptauth, keys, safefs
from trainyard.spec import CheckpointSpec

from jobs.core import dispatch
from jobs.core.errors import TransitionError
from jobs.models import Attempt, Checkpoint, Job
from jobs.attempts.rows import checkpoint_row
from jobs.attempts.policy import checkpoints as ckpt_policy
from jobs.attempts.services.busaccess import attempt_secrets
from jobs.attempts.services.events import job_event

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractUser

log = logging.getLogger(__name__)


def _checkpoint_root() -> Path:
    return Path(settings.TRAINYARD_CHECKPOINT_ROOT).resolve()


def _job_checkpoint_dir(job_id: int) -> Path:
    return keys.job_checkpoint_dir(_checkpoint_root(), job_id)


def checkpoint_states(job: Job) -> list[ckpt_policy.CheckpointState]:
    """The job's checkpoints as the policy sees them."""
    return [ckpt_policy.CheckpointState(c.pk, c.step, c.created_at.timestamp(), c.superseded, c.pinned,
                                        c.deleted_at is not None) for c in job.checkpoints.all()]


def resume_checkpoint(job: Job) -> Checkpoint | None:
    """The checkpoint the next attempt loads: only a complete one inside the job's checkpoint
    directory (checkpoint_verify); one whose directory vanished (deleted by hand) or changed is
    written off instead of failing the attempt on a missing path or loading from elsewhere."""
    while (point := ckpt_policy.resume_point(checkpoint_states(job))) is not None:
        c = Checkpoint.objects.get(pk=point.id)
        if c.attempt_id is not None:
            why = checkpoint_verify(job.pk, c.attempt_id, c.step, c.path)[1]
        else:  # registered before checkpoints named their attempt: inside the job's directory at least
            inside = Path(c.path).resolve().parent == _job_checkpoint_dir(job.pk)
            why = "" if inside and Path(c.path).is_dir() else f"{c.path} is not a directory inside the job's"
        if not why:
            return c
        log.warning("checkpoint %s of job %s cannot be resumed from (%s): skipping it", c.pk, job.pk, why)
        Checkpoint.objects.filter(pk=c.pk).update(deleted_at=timezone.now())
        checkpoint_publish(c)
    return None


def checkpoint_publish(c: Checkpoint) -> None:
    """Send the checkpoint's row to the job's page, after commit."""
    payload = {"type": "job.checkpoint", "checkpoint": checkpoint_row(c)}
    transaction.on_commit(partial(dispatch.publish, f"job.{c.job_id}", payload))


def _is_superseded(job: Job, attempt: Attempt, step: int) -> bool:
    """A checkpoint registered late (Redis was away; a save finished while its attempt stopped)
    belongs to a discarded future when a later attempt resumed from an earlier step or an admin
    rolled back behind it since its attempt began."""
    later = job.attempts.filter(number__gt=attempt.number).values_list("resumed_from_step", flat=True)
    if any((r or 0) < step for r in later):
        return True
    rollbacks = job.events.filter(kind="rollback", created_at__gte=attempt.created_at).values_list("data", flat=True)
    return any(int(d.get("step", 0)) < step for d in rollbacks)


MANIFEST_MAX_BYTES = 1 << 20
MANIFEST_FORMAT = 1  # trainyard/sdk/layout.py FORMAT


def _listed_files_missing(job_dir: Path, name: str, manifest: dict) -> str:
    """'' when every file the manifest lists is in the checkpoint directory `name` with its size
    (opened without following links: the directory is the job's); else what is missing."""
    files = manifest.get("files")
    if files is None:  # written before manifests had a list: at least one DCP data file
        try:
            names = [n for n, mode in safefs.list_beneath(job_dir, name) if stat.S_ISREG(mode)]
        except OSError:
            names = []
        return "" if any(n.endswith(".distcp") for n in names) else "no DCP data file (*.distcp)"
    if not isinstance(files, dict) or not files:
        return "its file list is not a non-empty object"
    for fname, size in files.items():
        if not isinstance(fname, str) or "/" in fname or "\\" in fname or fname in ("", ".", ".."):
            return f"it lists an unsafe file name {str(fname)[:80]!r}"
        try:
            fd = safefs.open_beneath(job_dir, f"{name}/{fname}")
        except OSError:
            return f"listed file {fname} is missing"
        try:
            actual = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if type(size) is int and actual != size:
            return f"listed file {fname} has {actual} bytes, the manifest says {size}"
    return ""


def checkpoint_verify(job_id: int, attempt_id: int, step: object, path: object) -> tuple[Path | None, str]:
    """(the checkpoint's directory, '') when `path` is a complete checkpoint of this job's attempt
    at this step, else (None, why not). Complete: the directory keys.step_dir_name(step, attempt)
    right inside the job's checkpoint directory (no `..`, nothing on the way a symlink: the job
    writes that directory), its manifest a regular JSON file naming the same job, attempt and step
    and carrying that attempt's proof (trainyard.attemptauth: made with the key of its sealed
    Launch, so a directory planted by anything but the attempt's own ranks never counts), and every
    file the manifest lists present with its size."""
    if type(step) is not int or step < 0 or not isinstance(path, str) or not path:
        return None, f"malformed checkpoint report: step {step!r:.40}, path {path!r:.200}"
    raw = Path(path)
    job_dir = _job_checkpoint_dir(job_id)
    name = keys.step_dir_name(step, attempt_id)
    if not raw.is_absolute() or ".." in raw.parts:
        return None, f"checkpoint path {path[:200]} is not an absolute path without '..'"
    if Path(os.path.normpath(raw)).parent != job_dir:
        return None, f"checkpoint path {path[:200]} is not a directory inside {job_dir}"
    if raw.name != name:
        return None, f"checkpoint directory {raw.name[:100]} is not {name}"
    manifest_path = job_dir / name / keys.MANIFEST
    try:
        manifest = json.loads(safefs.read_small(job_dir, f"{name}/{keys.MANIFEST}", max_bytes=MANIFEST_MAX_BYTES))
    except FileNotFoundError:
        return None, f"{job_dir / name} has no manifest {keys.MANIFEST}: not a complete checkpoint"
    except (OSError, ValueError) as exc:
        return None, f"unreadable manifest {manifest_path}: {str(exc)[:200]}"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None, f"{manifest_path} is not a format {MANIFEST_FORMAT} manifest"
    for key, want in (("job_id", job_id), ("attempt_id", attempt_id), ("step", step)):
        if manifest.get(key) != want or type(manifest.get(key)) is not int:
            return None, f"{manifest_path} says {key} {str(manifest.get(key))[:40]}, the report {want}"
    attempt = Attempt.objects.filter(pk=attempt_id, job_id=job_id).first()
    if attempt is None or not attemptauth.manifest_proof_ok(attempt_secrets(attempt).proof_key, manifest):
        return None, f"{manifest_path} carries no valid proof of attempt {attempt_id}: not written by its ranks"
    missing = _listed_files_missing(job_dir, name, manifest)
    if missing:
        return None, f"checkpoint {job_dir / name} is incomplete: {missing}"
    return job_dir / name, ""


def checkpoint_register(attempt_id: int, *, data: dict) -> Checkpoint | None:
    """Register a complete checkpoint, reported by the runtime's rank 0 after its directory got its
    final name (or found on disk by checkpoints_reconcile), once checkpoint_verify found it
    complete on disk. Idempotent per (job, path)."""
    attempt = Attempt.objects.select_related("job").filter(pk=attempt_id).first()
    if attempt is None:
        return None
    job = attempt.job
    path, why = checkpoint_verify(job.pk, attempt_id, data.get("step"), data.get("path"))
    if path is None:
        log.warning("ignoring checkpoint report of attempt %s: %s", attempt_id, why)
        return None
    step = data["step"]
    if attempt.fenced_step is not None and step > attempt.fenced_step:
        # Saved behind a partition after the attempt was written off (jobs/fleet/services/nodes.py,
        # attempt_fence): the job went on elsewhere from an earlier step; never a resume point.
        log.warning("refusing checkpoint %s of attempt %s: step %s is after its fence at step %s; deleting it",
                    path, attempt_id, step, attempt.fenced_step)
        # checkpoint_verify placed it inside this job's directory, complete and of this attempt:
        # nothing else will ever register it, and retention only sees registered checkpoints.
        transaction.on_commit(partial(_delete_checkpoint_files, str(path)))
        return None
    with transaction.atomic():
        existing = Checkpoint.objects.filter(job=job, path=str(path)).first()
        if existing is not None:
            return existing

        def num(key: str) -> float:
            v = data.get(key)
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0

        c = Checkpoint.objects.create(job=job, attempt=attempt, step=step, path=str(path),
                                      size_bytes=int(num("size_bytes")), blocking_s=num("blocking_s"),
                                      save_s=num("save_s"), superseded=_is_superseded(job, attempt, step))
        checkpoint_publish(c)
        _apply_retention(job)
    return c


def _apply_retention(job: Job) -> None:
    # The JobSpec's checkpoint section owns the default. Only that section is parsed: a cross-field
    # rule added after the job was stored must not stop its retention (nor the relay's batch).
    keep = CheckpointSpec.model_validate(job.spec.get("checkpoint") or {}).keep
    doomed = ckpt_policy.retention(checkpoint_states(job), keep)
    if not doomed:
        return
    Checkpoint.objects.filter(pk__in=doomed).update(deleted_at=timezone.now())
    for c in Checkpoint.objects.filter(pk__in=doomed):
        checkpoint_publish(c)
        transaction.on_commit(partial(_delete_checkpoint_files, c.path))


def _delete_checkpoint_files(path: str) -> None:
    """Delete one checkpoint directory: only a real directory (not a link a job put in its place)
    right inside a job's directory under the root; rmtree itself never follows links inside."""
    p = Path(os.path.normpath(path))
    if p.parent.parent != _checkpoint_root() or not p.parent.name.startswith("job-"):
        log.error("refusing to delete %s: not a checkpoint directory of a job under %s", p, _checkpoint_root())
        return
    try:
        if not stat.S_ISDIR(os.lstat(p).st_mode):
            log.error("refusing to delete %s: not a directory (a link planted in its place?)", p)
            return
    except FileNotFoundError:
        return
    shutil.rmtree(p, ignore_errors=True)


def checkpoints_reconcile(job: Job) -> int:
    """Register complete checkpoints found on disk but never reported (the runtime died, or Redis
    lost the report, between its rename and its report). A directory counts only with its
    manifest trainyard.json, which rank 0 writes last, before the rename."""
    root = _job_checkpoint_dir(job.pk)
    known = set(job.checkpoints.values_list("path", flat=True))
    found = 0
    try:
        entries = safefs.list_beneath(root)
    except OSError as exc:
        log.warning("cannot list %s: %s", root, exc)
        return 0
    for name, mode in entries:  # lstat modes: a link in the job's directory is never followed
        if not stat.S_ISDIR(mode) or not fnmatch.fnmatch(name, keys.STEP_DIR_GLOB) or str(root / name) in known:
            continue
        try:
            meta = json.loads(safefs.read_small(root, f"{name}/{keys.MANIFEST}", max_bytes=MANIFEST_MAX_BYTES))
            attempt_id = int(meta["attempt_id"])
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("unreadable checkpoint manifest in %s/%s", root, name)
            continue
        if not job.attempts.filter(pk=attempt_id).exists():
            continue
        if checkpoint_register(attempt_id, data={**meta, "path": str(root / name)}) is not None:
            found += 1
            log.info("registered checkpoint %s from its manifest", root / name)
    return found


def checkpoint_pin(checkpoint: Checkpoint, *, user: AbstractUser, pinned: bool) -> Checkpoint:
    """Pin (retention never deletes it) or unpin a checkpoint; unpinning may let retention delete
    older ones. Raises TransitionError (field "checkpoint") once retention deleted its files."""
    with transaction.atomic():
        c = Checkpoint.objects.select_for_update().get(pk=checkpoint.pk)
        if c.deleted_at is not None:
            raise TransitionError("the checkpoint's files were deleted by retention; it cannot be pinned",
                                  field="checkpoint")
        if c.pinned != pinned:
            Checkpoint.objects.filter(pk=c.pk).update(pinned=pinned)
            c.refresh_from_db()
            job_event(c.job, "checkpoint_pinned" if pinned else "checkpoint_unpinned",
                   f"checkpoint at step {c.step} {'pinned' if pinned else 'unpinned'} by {user.get_username()}",
                   actor=user, checkpoint=c.pk, step=c.step)
            checkpoint_publish(c)
            if not pinned:
                _apply_retention(c.job)
    return c
