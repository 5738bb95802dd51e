"""The login file: $XDG_CONFIG_HOME/trainyard/config.toml (default ~/.config/trainyard/config.toml).

It holds `url` and `token`; the file is created 0600 (never wider, not even for a moment) in a
0700 directory. TRAINYARD_URL and TRAINYARD_TOKEN override the file's values one by one.
"""
from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .errors import NOT_LOGGED_IN, CliError


@dataclass(frozen=True)
class Login:
    url: str
    token: str


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".config"  # the XDG spec ignores relative values
    return root / "trainyard" / "config.toml"


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise CliError(f"the server URL must start with http:// or https://, got {url!r}")
    return url


def read_file() -> dict:
    path = config_path()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}") from None
    return {k: v for k, v in data.items() if k in ("url", "token") and isinstance(v, str)}


def load() -> Login:
    """The URL and token to use, or CliError(not logged in)."""
    data = read_file()
    url = os.environ.get("TRAINYARD_URL") or data.get("url")
    token = os.environ.get("TRAINYARD_TOKEN") or data.get("token")
    if not url or not token:
        raise CliError(NOT_LOGGED_IN)
    return Login(normalize_url(url), token)


def save(url: str, token: str) -> Path:
    """Write the login file atomically: a new 0600 file (O_EXCL, no symlink followed) renamed over the old."""
    path = config_path()
    try:
        return _write(path, url, token)
    except OSError as exc:
        raise CliError(f"cannot save the login in {path}: {exc.strerror or exc}") from None


def _write(path: Path, url: str, token: str) -> Path:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in url + token):
        raise CliError("the URL and the token must not contain control characters")
    # A JSON string without control characters is a valid TOML basic string (same escapes for " and \\).
    text = (f"# written by `trainyard login`\nurl = {json.dumps(url, ensure_ascii=False)}\n"
            f"token = {json.dumps(token, ensure_ascii=False)}\n")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
