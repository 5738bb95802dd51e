"""Code bundles: store an upload content-addressed, answer the submit check, garbage-collect.

A bundle is a file at keys.bundle_path(artifact root, digest) plus its CodeBundle row. The file is
written first (a hard link from the finished upload, so it appears whole or not at all and never
overwrites), then the row; deletion removes the row, then the file. Every upload is checked by
trainyard.bundle.inspect_bundle before anything is stored. The bottom of the services: it imports
no other topic.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import datetime
from datetime import timezone as dt_timezone
from pathlib import Path
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models.functions import Coalesce
from django.utils import timezone

from ..errors import InvalidInput, PayloadTooLarge
from ..models import CodeBundle, Job
from trainyard import keys
from trainyard.bundle import BundleError, BundleInfo, BundleLimits, inspect_bundle, is_digest

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractUser

log = logging.getLogger(__name__)

INCOMING_DIR = ".incoming"
"""Under <artifact root>/bundles/: uploads being received (same filesystem as the store)."""
INCOMING_MIN_AGE_S = 3600
"""An upload younger than this may still be arriving: the garbage collector leaves it."""


def bundle_limits() -> BundleLimits:
    return BundleLimits(max_files=settings.TRAINYARD_BUNDLE_MAX_FILES, max_bytes=settings.TRAINYARD_BUNDLE_MAX_BYTES,
                        max_unpacked=settings.TRAINYARD_BUNDLE_MAX_UNPACKED_BYTES)


def bundle_file(digest: str) -> Path:
    return keys.bundle_path(Path(settings.TRAINYARD_ARTIFACT_ROOT), digest)


def incoming_dir() -> Path:
    """Where uploads are streamed while they arrive (created on demand)."""
    path = Path(settings.TRAINYARD_ARTIFACT_ROOT) / "bundles" / INCOMING_DIR
    path.mkdir(parents=True, exist_ok=True)
    return path


def _refusal(exc: BundleError) -> InvalidInput | PayloadTooLarge:
    return (PayloadTooLarge if exc.status == 413 else InvalidInput)({"file": [exc.message]})


def bundle_store(*, user: AbstractUser, upload: Path, digest: str) -> tuple[CodeBundle, bool]:
    """Stores the uploaded file at `upload` (sha256 `digest`, computed while it was received) as a
    bundle; (bundle, created). A bundle already stored is not inspected or written again, only
    marked used. Raises InvalidInput / PayloadTooLarge on field "file", storing nothing."""
    existing = CodeBundle.objects.filter(digest=digest).first()
    if existing is not None and bundle_file(digest).is_file():
        bundle_mark_used(digest)
        return existing, False
    try:
        info = inspect_bundle(upload, limits=bundle_limits())
    except BundleError as exc:
        raise _refusal(exc) from None
    if info.digest != digest:  # the temp file changed under us: refuse rather than store a mislabel
        raise InvalidInput({"file": ["the upload changed while it was being checked; send it again"]})
    _publish(upload, info)
    return _row(user, info)


def _publish(upload: Path, info: BundleInfo) -> None:
    final = bundle_file(info.digest)
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(upload, final)
    except FileExistsError:
        return  # stored by a concurrent upload (or a row lost since): same name, same bytes
    os.chmod(final, 0o444)


def _row(user: AbstractUser, info: BundleInfo) -> tuple[CodeBundle, bool]:
    fields = {"bytes": info.bytes, "files": info.files, "file_list": list(info.names), "owner": user,
              "last_used_at": timezone.now()}
    try:
        with transaction.atomic():
            return CodeBundle.objects.get_or_create(digest=info.digest, defaults=fields)
    except IntegrityError:  # the same bundle created concurrently
        return CodeBundle.objects.get(digest=info.digest), False


def bundle_files(digest: str) -> frozenset[str] | None:
    """The submit check: the regular files of stored bundle `digest`, or None when no such bundle
    is stored (unknown digest, deleted, or its file gone). Marks the bundle used, so the garbage
    collector keeps a bundle a job is being submitted with."""
    if not is_digest(digest):
        return None
    bundle = CodeBundle.objects.filter(digest=digest).first()
    if bundle is None or not bundle_file(digest).is_file():
        return None
    bundle_mark_used(digest)
    return frozenset(bundle.file_list)


def bundle_mark_used(digest: str) -> None:
    CodeBundle.objects.filter(digest=digest).update(last_used_at=timezone.now())


def bundle_delete(bundle: CodeBundle) -> None:
    """Removes a bundle's row, then its file (the admin's delete and the garbage collector)."""
    digest = bundle.digest
    bundle.delete()
    bundle_file(digest).unlink(missing_ok=True)


def referenced_digests() -> set[str]:
    """Every bundle some job's spec names in code.bundle (any status: a job keeps its code)."""
    rows = Job.objects.filter(spec__code__bundle__isnull=False).values_list("spec__code__bundle", flat=True)
    return {r for r in rows if isinstance(r, str)}


@dataclass(frozen=True)
class GcResult:
    deleted: list[str]
    orphan_files: int
    stale_uploads: int
    freed_bytes: int


def bundles_gc(*, age_s: float | None = None, now: float | None = None) -> GcResult:
    """Deletes bundles no job references whose last use (upload, re-upload, submit) is older than
    `age_s` (settings.TRAINYARD_BUNDLE_GC_AGE_S); also bundle files without a row and abandoned
    uploads older than that."""
    age_s = settings.TRAINYARD_BUNDLE_GC_AGE_S if age_s is None else age_s
    now = time.time() if now is None else now
    cutoff = datetime.fromtimestamp(now - age_s, tz=dt_timezone.utc)
    old = _unused_since(cutoff).exclude(digest__in=referenced_digests())
    deleted, freed = [], 0
    for bundle in old:
        with transaction.atomic():
            # a submit since the query marked the bundle used or references it: check again, then delete
            if (not _unused_since(cutoff).filter(pk=bundle.pk).exists()
                    or Job.objects.filter(spec__code__bundle=bundle.digest).exists()):
                continue
            bundle_delete(bundle)
        deleted.append(bundle.digest)
        freed += bundle.bytes
    orphans, freed_orphans = _sweep_files(now - age_s)
    stale = _sweep_incoming(min(now - age_s, now - INCOMING_MIN_AGE_S))
    if deleted or orphans or stale:
        log.info("bundle gc: %d bundle(s), %d orphan file(s), %d stale upload(s), %d bytes",
                 len(deleted), orphans, stale, freed + freed_orphans)
    return GcResult(deleted, orphans, stale, freed + freed_orphans)


def _unused_since(cutoff: datetime):
    return CodeBundle.objects.annotate(used=Coalesce("last_used_at", "created_at")).filter(used__lt=cutoff)


def _sweep_files(cutoff_ts: float) -> tuple[int, int]:
    """Bundle files with no row (a store that crashed between file and row), older than the cutoff."""
    root = Path(settings.TRAINYARD_ARTIFACT_ROOT) / "bundles"
    if not root.is_dir():
        return 0, 0
    on_disk = {}
    for path in root.glob("[0-9a-f][0-9a-f]/*.tar.gz"):
        digest = keys.BUNDLE_PREFIX + path.name.removesuffix(".tar.gz")
        if is_digest(digest):
            on_disk[digest] = path
    known = set(CodeBundle.objects.filter(digest__in=list(on_disk)).values_list("digest", flat=True))
    count = freed = 0
    for digest, path in on_disk.items():
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        if digest not in known and st.st_mtime < cutoff_ts:
            path.unlink(missing_ok=True)
            count, freed = count + 1, freed + st.st_size
    return count, freed


def _sweep_incoming(cutoff_ts: float) -> int:
    """Uploads a crashed request left in .incoming/ (a live one is removed when its request ends)."""
    directory = Path(settings.TRAINYARD_ARTIFACT_ROOT) / "bundles" / INCOMING_DIR
    count = 0
    if directory.is_dir():
        for path in directory.iterdir():
            try:
                if path.is_file() and path.stat().st_mtime < cutoff_ts:
                    path.unlink()
                    count += 1
            except FileNotFoundError:
                continue
    return count

