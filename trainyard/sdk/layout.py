"""The on-disk layout of checkpoints (torch-free): names, the manifest, the atomic publish.

Under <checkpoint_dir> (= <root>/job-<id>; ./checkpoints for a standalone SDK run):

    step-<S:08d>-a<attempt>/            a complete checkpoint, and only with trainyard.json in it
    .partial-step-<S:08d>-a<attempt>/   a save in progress, or one a crash cut short: never a
                                        checkpoint; rank 0 of a later attempt deletes it at start

The control plane registers a checkpoint from the `checkpoint` event and reconciles from the
manifests (MANIFEST_KEYS), so this is a contract. checkpoint.py writes into it.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from trainyard.keys import MANIFEST  # the one manifest name, shared with the control plane

from .config import ConfigError, ResumeConfig

FORMAT = 1
PARTIAL = ".partial-"
MANIFEST_KEYS = ("format", "job_id", "attempt_id", "step", "world_size", "created_unixtime",
                 "size_bytes", "blocking_s", "save_s", "files")


def final_name(step: int, attempt_id: int) -> str:
    return f"step-{step:08d}-a{attempt_id}"


def partial_name(step: int, attempt_id: int) -> str:
    return PARTIAL + final_name(step, attempt_id)


def is_due(step: int, every_steps: int, last_step: int) -> bool:
    return step % every_steps == 0 or step == last_step


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())


def publish(partial: Path, manifest: dict) -> Path:
    """Make a complete .partial-* directory a checkpoint: manifest (fsync), rename, fsync parent.

    A crash before the rename leaves a .partial-* directory (never a checkpoint); after it, a
    step-* directory with its manifest. There is no state in between.
    """
    partial = Path(partial)
    if not partial.name.startswith(PARTIAL):
        raise ValueError(f"{partial} is not a {PARTIAL}* directory")
    with open(partial / MANIFEST, "w", encoding="utf-8") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    final = partial.with_name(partial.name[len(PARTIAL):])
    os.rename(partial, final)
    fsync_dir(final.parent)
    return final


def read_manifest(path: Path) -> dict:
    """The manifest of the complete checkpoint at `path`; ConfigError naming the path otherwise."""
    path = Path(path)
    if path.name.startswith(PARTIAL):
        raise ConfigError(f"resume.path {path} is an unfinished save ({PARTIAL}*), not a checkpoint")
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        what = "has no" if path.is_dir() else "does not exist, so no"
        raise ConfigError(f"resume.path {path} {what} {MANIFEST}: not a complete checkpoint") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"resume.path {path}: unreadable {MANIFEST}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(f"resume.path {path}: {MANIFEST} is not format {FORMAT}: {manifest!r}")
    return manifest


def resume_manifest(resume: ResumeConfig) -> dict:
    """Check the resume point before the rendezvous, so a bad path fails fast and clearly."""
    manifest = read_manifest(resume.path)
    if manifest.get("step") != resume.step:
        raise ConfigError(f"resume.step={resume.step} but {resume.path / MANIFEST} says step "
                          f"{manifest.get('step')}")
    return manifest


def remove_stale_partials(checkpoint_dir: Path, attempt_id: int) -> list[Path]:
    """Delete .partial-* directories other attempts left behind (their saves can never finish)."""
    own = f"-a{attempt_id}"
    stale = [p for p in Path(checkpoint_dir).glob(PARTIAL + "*")
             if p.is_dir() and not p.name.endswith(own)]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def latest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step under `checkpoint_dir` (a standalone run's
    resume point), or None."""
    best: tuple[int, Path] | None = None
    for path in Path(checkpoint_dir).glob("step-*"):
        try:
            step = read_manifest(path)["step"]
        except ConfigError:
            continue
        if isinstance(step, int) and (best is None or (step, path.name) > (best[0], best[1].name)):
            best = (step, path)
    return best[1] if best else None
