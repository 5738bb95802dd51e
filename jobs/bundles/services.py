"""Code bundles: store an upload content-addressed, answer the submit check, garbage-collect.

A bundle is a file at keys.bundle_path(artifact root, digest) plus its CodeBundle row. The file is
written first (a hard link from the finished upload, so it appears whole or not at all and never
overwrites), then the row; deletion removes the row, then the file. Every upload is checked by
trainyard.bundle.inspect_bundle before anything is stored. The bottom of the services: it imports
no other topic.

The artifact root is shared with the nodes, so every open below it on a job's behalf (store, the
stored check, delete, GC) goes through trainyard.safefs: no symlink below the root is followed and
only regular files are read (a link or another kind of file where a bundle, a bucket directory or
.incoming/ should be is refused and logged). Uploads are received in a unique O_EXCL file under
.incoming/ (`IncomingUpload`) and published by a hard link made through directory descriptors.
"""
from __future__ import annotations

import logging
import os
import secrets
import stat
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

from jobs.core.errors import InvalidInput, PayloadTooLarge
from jobs.models import CodeBundle, Job
from trainyard import keys, safefs
from trainyard.bundle import BundleError, BundleInfo, BundleLimits, inspect_bundle, is_digest, open_stored
from trainyard.safefs import UnsafePath

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractUser

log = logging.getLogger(__name__)

INCOMING_DIR = ".incoming"
"""Under <artifact root>/bundles/: uploads being received (same filesystem as the store)."""
INCOMING_MIN_AGE_S = 3600
"""An upload younger than this may still be arriving: the garbage collector leaves it."""


BUCKET_DIR_MODE = 0o777
"""bundles/<hex[:2]>/ directories: as mkdir makes them (the umask applies): the nodes read them."""


def bundle_limits() -> BundleLimits:
    return BundleLimits(max_files=settings.TRAINYARD_BUNDLE_MAX_FILES, max_bytes=settings.TRAINYARD_BUNDLE_MAX_BYTES,
                        max_unpacked=settings.TRAINYARD_BUNDLE_MAX_UNPACKED_BYTES,
                        max_depth=settings.TRAINYARD_BUNDLE_MAX_DEPTH)


def _root(*, create: bool = False) -> Path:
    """The artifact root (trusted: the operator's); `create` makes it when missing."""
    root = Path(settings.TRAINYARD_ARTIFACT_ROOT)
    if create:
        root.mkdir(parents=True, exist_ok=True)
    return root


def _rel(digest: str) -> Path:
    return keys.bundle_path(Path("."), digest)


def bundle_file(digest: str) -> Path:
    return keys.bundle_path(_root(), digest)


def _stored(digest: str) -> bool:
    """Whether bundle `digest` is stored as a regular file (no symlink on the way followed)."""
    try:
        os.close(open_stored(_root(), digest))
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:  # UnsafePath (a planted link or FIFO), or an artifact root that is not a directory
        log.warning("bundle %s: refused its stored file (not followed): %s", digest, exc)
        return False


def incoming_dir() -> Path:
    """Where uploads are streamed while they arrive (created on demand, never through a link)."""
    os.close(safefs.open_dir(_root(create=True), f"bundles/{INCOMING_DIR}", make_dirs=True))
    return _root() / "bundles" / INCOMING_DIR


class IncomingUpload:
    """An upload being received: a new file with a unique O_EXCL name in <artifact root>/bundles/.incoming/
    (a real directory: a link there is refused), open for reading and writing; `close` removes it."""

    def __init__(self):
        self.dir_fd = safefs.open_dir(_root(create=True), f"bundles/{INCOMING_DIR}", make_dirs=True)
        try:
            fd, self.name = safefs.create_temp(self.dir_fd, "upload-", access=os.O_RDWR)
        except BaseException:
            os.close(self.dir_fd)
            raise
        self.file = os.fdopen(fd, "w+b")
        self.closed_ = False

    def __getattr__(self, name):  # read, write, seek, tell, flush, fileno ... of the open file
        file = self.__dict__.get("file")
        if file is None:
            raise AttributeError(name)
        return getattr(file, name)

    @property
    def path(self) -> Path:
        return incoming_dir() / self.name

    def close(self) -> None:
        if self.closed_:
            return
        self.closed_ = True
        safefs.unlink_quietly(self.dir_fd, self.name)
        self.file.close()
        os.close(self.dir_fd)


def _refusal(exc: BundleError) -> InvalidInput | PayloadTooLarge:
    return (PayloadTooLarge if exc.status == 413 else InvalidInput)({"file": [exc.message]})


def bundle_store(*, user: AbstractUser, upload: IncomingUpload, digest: str) -> tuple[CodeBundle, bool]:
    """Stores the received `upload` (sha256 `digest`, computed while it was received) as a
    bundle; (bundle, created). A bundle already stored is not inspected or written again, only
    marked used. Raises InvalidInput / PayloadTooLarge on field "file", storing nothing."""
    existing = CodeBundle.objects.filter(digest=digest).first()
    if existing is not None and _stored(digest):
        bundle_mark_used(digest)
        return existing, False
    try:
        info = inspect_bundle(upload.fileno(), limits=bundle_limits())
    except BundleError as exc:
        raise _refusal(exc) from None
    if info.digest != digest:  # the temp file changed under us: refuse rather than store a mislabel
        raise InvalidInput({"file": ["the upload changed while it was being checked; send it again"]})
    _publish(upload, info)
    return _row(user, info)


def _publish(upload: IncomingUpload, info: BundleInfo) -> None:
    """Hard-link the upload into the store through directory descriptors (a link planted in place of
    a bucket directory is refused; one in place of the bundle file is replaced, never followed)."""
    rel = _rel(info.digest)
    bucket = safefs.open_dir(_root(create=True), rel.parent, make_dirs=True, dir_mode=BUCKET_DIR_MODE)
    try:
        os.fchmod(upload.fileno(), 0o444)  # the same inode as the stored file: read-only from its first name
        try:
            os.link(upload.name, rel.name, src_dir_fd=upload.dir_fd, dst_dir_fd=bucket, follow_symlinks=False)
        except FileExistsError:
            if stat.S_ISREG(os.lstat(rel.name, dir_fd=bucket).st_mode):
                return  # stored by a concurrent upload (or a row lost since): same name, same bytes
            log.warning("bundle %s: a link or another kind of file was in its place; replaced", info.digest)
            tmp = f".{rel.name}.{secrets.token_hex(8)}.tmp"
            os.link(upload.name, tmp, src_dir_fd=upload.dir_fd, dst_dir_fd=bucket, follow_symlinks=False)
            os.replace(tmp, rel.name, src_dir_fd=bucket, dst_dir_fd=bucket)
    finally:
        os.close(bucket)


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
    if bundle is None or not _stored(digest):
        return None
    bundle_mark_used(digest)
    return frozenset(bundle.file_list)


def bundle_mark_used(digest: str) -> None:
    CodeBundle.objects.filter(digest=digest).update(last_used_at=timezone.now())


def bundle_delete(bundle: CodeBundle) -> None:
    """Removes a bundle's row, then its file (the admin's delete and the garbage collector)."""
    digest = bundle.digest
    bundle.delete()
    try:
        safefs.remove_beneath(_root(), _rel(digest))  # a link in its place goes itself, never its target
    except OSError as exc:
        log.warning("bundle %s: cannot remove its stored file: %s", digest, exc)


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


def _listing(rel: str) -> list[tuple[str, os.stat_result]]:
    """Entries of a directory below the artifact root (lstat), [] when it is missing or refused."""
    try:
        return safefs.scan_beneath(_root(), rel)
    except UnsafePath as exc:
        log.warning("bundle gc: refused %s (not followed): %s", rel, exc)
    except OSError:
        pass
    return []


def _sweep_files(cutoff_ts: float) -> tuple[int, int]:
    """Bundle files with no row (a store that crashed between file and row), older than the cutoff;
    an entry that is not a regular file (a planted link) is removed itself, never followed."""
    on_disk: dict[str, tuple[str, os.stat_result]] = {}
    for bucket, st in _listing("bundles"):
        if len(bucket) != 2 or bucket == ".." or not stat.S_ISDIR(st.st_mode):
            continue
        for name, fst in _listing(f"bundles/{bucket}"):
            digest = keys.BUNDLE_PREFIX + name.removesuffix(".tar.gz")
            if name.endswith(".tar.gz") and is_digest(digest) and name.startswith(bucket):
                on_disk[digest] = (f"bundles/{bucket}/{name}", fst)
    known = set(CodeBundle.objects.filter(digest__in=list(on_disk)).values_list("digest", flat=True))
    count = freed = 0
    for digest, (rel, st) in on_disk.items():
        if digest not in known and st.st_mtime < cutoff_ts and _remove(rel):
            count, freed = count + 1, freed + (st.st_size if stat.S_ISREG(st.st_mode) else 0)
    return count, freed


def _remove(rel: str) -> bool:
    try:
        return safefs.remove_beneath(_root(), rel)
    except OSError as exc:
        log.warning("bundle gc: cannot remove %s: %s", rel, exc)
        return False


def _sweep_incoming(cutoff_ts: float) -> int:
    """Uploads a crashed request left in .incoming/ (a live one is removed when its request ends)."""
    count = 0
    for name, st in _listing(f"bundles/{INCOMING_DIR}"):
        if not stat.S_ISDIR(st.st_mode) and st.st_mtime < cutoff_ts and _remove(f"bundles/{INCOMING_DIR}/{name}"):
            count += 1
    return count
