"""Opening paths that untrusted code can write, without following what it planted (standard
library only; Linux and any POSIX with O_NOFOLLOW and dir_fd).

A job's ranks write their run directory's logs/, ranks/ and tmp/, and their job's checkpoint
directory. Anything that reads or writes there on the job's behalf with more rights than the job
(the node agent tailing logs and error files, the control plane verifying manifests, the relay
appending kept logs) must not be steered elsewhere by a symlink, a FIFO or a device node the job
put in place of a file or a directory: `logs/attempt_0/0/stderr.log -> /var/lib/trainyard/secret_key`
would otherwise be read by the agent and streamed back to the job's owner.

`open_beneath(root, rel)` walks `rel` one component at a time from a descriptor of `root` (trusted:
configured by the operator, opened normally), each directory with O_NOFOLLOW | O_DIRECTORY and the
last component with O_NOFOLLOW, so a symlink anywhere below `root` is refused (ELOOP or ENOTDIR)
rather than followed, and no rename between a check and the open can redirect it: there is no
separate check. A file opened must be a regular file (FIFOs are opened non-blocking, so one cannot
stall the reader or the writer, and then refused). `..`, `.` and absolute parts are refused.

For writers: `open_dir` (a directory descriptor, missing directories made), `create_temp` (a unique
O_EXCL | O_NOFOLLOW name, never a fixed one a job could plant a link at), `replace_file` (temporary
file, then a rename within one directory descriptor: a link at the name is replaced, not followed),
`remove_beneath` (a tree removed through descriptors, a link removed itself).
"""
from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from pathlib import Path, PurePosixPath

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(OSError):
    """A path below a trusted root is a symlink, not a directory where one is needed, not a
    regular file where one is read, or names `..`: refused, never followed."""


def _parts(rel: str | os.PathLike) -> list[str]:
    rel_path = PurePosixPath(os.fspath(rel))
    if rel_path.is_absolute():
        raise UnsafePath(errno.EINVAL, f"{rel_path} is absolute, not relative to its root")
    parts = [p for p in rel_path.parts if p not in ("", ".")]
    if not parts or ".." in parts:
        raise UnsafePath(errno.EINVAL, f"{rel_path!s} is not a path inside its root")
    return parts


def _walk(root_fd: int, parts: list[str], *, create: bool = False, dir_mode: int = 0o700) -> int:
    """A descriptor of the directory `parts` below `root_fd` (which stays open), each component
    opened without following symlinks; with `create`, missing directories are made."""
    fd = os.dup(root_fd)
    try:
        for name in parts:
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, dir_mode, dir_fd=fd)
                except FileExistsError:
                    pass  # made meanwhile: the open below decides whether it is a directory
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePath(exc.errno, f"{name!r} is a symlink or not a directory") from None
                raise
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_root(root: str | os.PathLike) -> int:
    """A descriptor of a trusted root directory (followed if the operator made it a symlink)."""
    return os.open(os.fspath(root), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def open_beneath(root: str | os.PathLike | int, rel: str | os.PathLike, flags: int = os.O_RDONLY,
                 mode: int = 0o600, *, make_dirs: bool = False, dir_mode: int = 0o700) -> int:
    """A descriptor of `root`/`rel`, no symlink followed below `root` (an int `root` is an open
    directory descriptor, left open). Opened for reading, the target must be a regular file or,
    with O_DIRECTORY in `flags`, a directory. `make_dirs`: create missing parent directories."""
    parts = _parts(rel)
    root_fd = root if isinstance(root, int) else open_root(root)
    try:
        parent = _walk(root_fd, parts[:-1], create=make_dirs, dir_mode=dir_mode)
    finally:
        if not isinstance(root, int):
            os.close(root_fd)
    try:
        extra = os.O_NOFOLLOW | os.O_CLOEXEC
        if not flags & os.O_DIRECTORY:
            # a FIFO opens at once (and is refused below) instead of blocking; opened for writing
            # with no reader it fails with ENXIO (refused too)
            extra |= os.O_NONBLOCK
        try:
            fd = os.open(parts[-1], flags | extra, mode, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
                raise UnsafePath(exc.errno, f"{parts[-1]!r} is a symlink or not a file") from None
            raise
    finally:
        os.close(parent)
    try:
        st = os.fstat(fd)
        want_dir = bool(flags & os.O_DIRECTORY)
        if (want_dir and not stat.S_ISDIR(st.st_mode)) or (not want_dir and not stat.S_ISREG(st.st_mode)):
            raise UnsafePath(errno.EINVAL, f"{parts[-1]!r} is not a regular {'directory' if want_dir else 'file'}")
        if extra & os.O_NONBLOCK and not want_dir:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_beneath(root: str | os.PathLike | int, rel: str | os.PathLike, *, max_bytes: int,
                 offset: int = 0) -> bytes:
    """At most `max_bytes` of the regular file `root`/`rel` from `offset` (no symlink followed)."""
    fd = open_beneath(root, rel)
    try:
        return os.pread(fd, max_bytes, offset) if max_bytes > 0 else b""
    finally:
        os.close(fd)


def read_small(root: str | os.PathLike | int, rel: str | os.PathLike, *, max_bytes: int) -> bytes:
    """The whole regular file `root`/`rel`; UnsafePath if it is larger than `max_bytes`."""
    fd = open_beneath(root, rel)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise UnsafePath(errno.EFBIG, f"{os.fspath(rel)} is {size} bytes, over the {max_bytes} byte limit")
        return os.pread(fd, max_bytes + 1, 0)[:max_bytes]
    finally:
        os.close(fd)


def scan_beneath(root: str | os.PathLike | int, rel: str | os.PathLike = ".") -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of every entry of the directory `root`/`rel`, sorted by name (a symlink is
    listed as one, never followed); [] when the directory does not exist."""
    try:
        fd = open_dir(root, rel)
    except FileNotFoundError:
        return []
    try:
        out = []
        for name in os.listdir(fd):
            try:
                out.append((name, os.lstat(name, dir_fd=fd)))
            except FileNotFoundError:
                continue  # removed since the listing
        return sorted(out, key=lambda e: e[0])
    finally:
        os.close(fd)


def list_beneath(root: str | os.PathLike | int, rel: str | os.PathLike = ".") -> list[tuple[str, int]]:
    """(name, st_mode) of every entry of the directory `root`/`rel` (lstat: a symlink is listed as
    one, never followed); [] when the directory does not exist."""
    return [(name, st.st_mode) for name, st in scan_beneath(root, rel)]


def is_inside(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """Whether `path`, made absolute and normalised without resolving symlinks, lies below `root`
    (for refusing a configured path before anything is opened; opens use open_beneath)."""
    p = Path(os.path.normpath(os.path.abspath(os.fspath(path))))
    r = Path(os.path.normpath(os.path.abspath(os.fspath(root))))
    return p == r or r in p.parents


# ---------------------------------------------------------------- directories, temporary files, removal

def open_dir(root: str | os.PathLike | int, rel: str | os.PathLike = ".", *, make_dirs: bool = False,
             dir_mode: int = 0o700) -> int:
    """A descriptor of the directory `root`/`rel` (`rel` "." is `root` itself), no symlink followed
    below `root`; with `make_dirs`, missing directories are created (`dir_mode`)."""
    rel_path = PurePosixPath(os.fspath(rel))
    parts = [p for p in rel_path.parts if p not in ("", ".")]
    if rel_path.is_absolute() or ".." in parts:
        raise UnsafePath(errno.EINVAL, f"{rel_path!s} is not a path inside its root")
    root_fd = root if isinstance(root, int) else open_root(root)
    try:
        return _walk(root_fd, parts, create=make_dirs, dir_mode=dir_mode)
    finally:
        if not isinstance(root, int):
            os.close(root_fd)


TEMP_TRIES = 16


def create_temp(dir_fd: int, prefix: str, mode: int = 0o600, *, access: int = os.O_WRONLY) -> tuple[int, str]:
    """A new, empty file in the directory `dir_fd` under a unique name (`prefix`, random hex,
    ".tmp"), created with O_EXCL | O_NOFOLLOW: nothing planted under a guessed name is opened or
    followed. (descriptor open for writing, or `access` (os.O_RDWR), name)."""
    for _ in range(TEMP_TRIES):
        name = f"{prefix}{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(name, access | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                         dir_fd=dir_fd)
        except FileExistsError:
            continue
        return fd, name
    raise FileExistsError(errno.EEXIST, f"no free temporary name for {prefix!r} after {TEMP_TRIES} tries")


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte of `data` is written."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def replace_file(dir_fd: int, name: str, data: bytes, mode: int = 0o600, *, fsync: bool = False) -> None:
    """Put `data` at `name` in the directory `dir_fd` atomically: written to a unique O_EXCL
    temporary file there, then renamed over `name` (a symlink at `name` is replaced, never followed;
    readers holding the old file keep it)."""
    fd, tmp = create_temp(dir_fd, f".{name}.")
    try:
        try:
            write_all(fd, data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        unlink_quietly(dir_fd, tmp)
        raise


def unlink_quietly(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def remove_beneath(root: str | os.PathLike | int, rel: str | os.PathLike) -> bool:
    """Delete `root`/`rel`: a directory with everything in it (shutil.rmtree on descriptors, which
    never follows a symlink inside the tree), or a file or symlink (the link itself). No symlink on
    the way there is followed. False when there was nothing to delete."""
    parts = _parts(rel)
    try:
        parent = open_dir(root, "/".join(parts[:-1]) or ".")
    except FileNotFoundError:
        return False
    try:
        try:
            st = os.lstat(parts[-1], dir_fd=parent)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(parts[-1], dir_fd=parent)
        else:
            os.unlink(parts[-1], dir_fd=parent)
        return True
    finally:
        os.close(parent)
