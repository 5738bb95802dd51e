"""Files only their owner may read (standard library only): the state under TRAINYARD_VAR_DIR.

The database, the secret key, the admin password and the node agents' run directories (whose
config.json holds the Redis URL, password included) are created 0600 (files) and 0700
(directories) whatever the umask, and a looser mode left by an older version is tightened when the
process that owns them starts (issue 15, section 3). Before, they were 0644/0755 under the default
umask 022: any local user could read the session-signing key and the admin password.
"""
from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: str | os.PathLike) -> Path:
    """Create `path` (and its missing parents) 0700, or tighten it to 0700 if it exists."""
    p = Path(path)
    p.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.chmod(p, DIR_MODE)
    return p


def tighten(path: str | os.PathLike) -> bool:
    """Take group and other permissions off an existing file or directory (the owner's stay as they
    are); True if it was looser. A missing path is left missing."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_IMODE(mode) & 0o077:
        return False
    os.chmod(path, stat.S_IMODE(mode) & ~0o077)
    return True


def write_private(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` atomically, 0600 from its first byte (never briefly world-readable)."""
    # A unique name made with O_EXCL | O_NOFOLLOW: nothing planted beside `path` (a symlink where
    # the temporary file would go) can be written through.
    tmp = f"{os.fspath(path)}.tmp.{os.getpid()}.{secrets.token_hex(6)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # a leftover temporary file keeps its old mode through O_CREAT
        with os.fdopen(fd, "w") as f:
            fd = -1
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def redacted_url(url: str) -> str:
    """`url` with its password replaced by '***' (for logs and banners): redis://:***@host:6379/0."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparsable URL>"
    if not password:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user = userinfo.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hostport}"))
