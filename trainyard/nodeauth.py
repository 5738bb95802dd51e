"""Node identity on the bus (standard library only): every report a node agent sends to the
control queue is a signed envelope, and the control plane applies it only if the signature is the
registered node's (issue 16, section 1).

Before, anyone who could reach Redis could send a heartbeat or an exit report under any node's
name: a forged `address` became the next job's rendezvous host, a forged `slots: 4096` put 64
processes on a 2-slot node, a forged exit report failed another user's job.

    envelope = {"node": "node-a", "task": HEARTBEAT_TASK, "ts": 1764471234.1, "body": {...},
                "sig": hex(HMAC-SHA256(credential, canonical(node, task, ts, body)))}

The task name is signed with the body, so a signed heartbeat cannot be replayed as an exit report.

The credential: `manage.py node_add` draws a random salt and derives the node's credential as
HMAC-SHA256(master key, name + salt) (`derive_credential`); the database keeps only the salt and
the credential's SHA-256 (`fingerprint`), never the credential, so a copy of the database alone
signs nothing. The master key (TRAINYARD_NODE_KEY, by default derived from Django's SECRET_KEY)
never leaves the control plane; the credential is shown once and lives on the node in a 0600 file
(`read_credential_file` refuses one that group or others can read, as ssh does its keys).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import stat
from typing import Any


class CredentialFileError(Exception):
    """The credential file is missing, unreadable, empty, or readable by others."""


def derive_credential(master_key: bytes, name: str, salt: str) -> str:
    """The node's credential (43 url-safe characters, 256 bits): what the agent signs with."""
    digest = hmac.new(master_key, f"trainyard-node\0{name}\0{salt}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def fingerprint(credential: str) -> str:
    """What the database stores of a credential: its SHA-256, hex."""
    return hashlib.sha256(credential.encode()).hexdigest()


def canonical(node: str, task: str, ts: float, body: Any) -> bytes:
    """The signed bytes: one JSON text with sorted keys, so both ends compute the same ones."""
    return json.dumps({"node": node, "task": task, "ts": ts, "body": body}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def sign(credential: str, node: str, task: str, ts: float, body: Any) -> str:
    return hmac.new(credential.encode(), canonical(node, task, ts, body), hashlib.sha256).hexdigest()


def seal(credential: str | None, node: str, task: str, body: Any, ts: float) -> dict:
    """The envelope a node sends. Without a credential (an unregistered node asking to join) the
    signature is empty and the control plane shows the heartbeat to staff as a join request."""
    return {"node": node, "task": task, "ts": ts, "body": body,
            "sig": sign(credential, node, task, ts, body) if credential else ""}


def signature_ok(credential: str, envelope: dict) -> bool:
    """True if the envelope's signature is this credential's over its node, task, ts and body."""
    sig = envelope.get("sig")
    if not isinstance(sig, str) or not sig:
        return False
    try:
        want = sign(credential, envelope["node"], envelope["task"], envelope["ts"], envelope["body"])
    except (KeyError, TypeError, ValueError):
        return False
    return hmac.compare_digest(want, sig)


def read_credential_file(path: str | os.PathLike) -> str:
    """The credential in `path`, refusing a file that anyone but its owner may read (or that
    another user owns): a credential others can read is a credential others can sign with."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise CredentialFileError(f"cannot open credential file {os.fspath(path)}: {exc.strerror}") from exc
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CredentialFileError(f"credential file {os.fspath(path)} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise CredentialFileError(
                f"credential file {os.fspath(path)} has mode {mode:04o}: group and others must not read it "
                f"(chmod 600 {os.fspath(path)})")
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise CredentialFileError(f"credential file {os.fspath(path)} belongs to uid {st.st_uid}, "
                                      f"not to this agent's user (uid {os.getuid()})")
        text = f.read(4096).strip()
    if not text:
        raise CredentialFileError(f"credential file {os.fspath(path)} is empty")
    return text
