"""Redis ACL users for the bus (standard library only; issue 16, section 1): one user for the
control plane, one per node, each with a random password; the default user is off, so a client
without a password can do nothing (`NOAUTH`).

A node's user reaches only what its agent and its ranks use (trainyard.keys): its own queue
(`node.<name>`, BRPOP; kombu's priority variants share the prefix), the control queue (LPUSH of
its signed reports), kombu's bindings and unacked bookkeeping, the job streams (XADD of
telemetry and logs), the rendezvous-port and preemption keys, and no pub/sub channel. It cannot
read another node's queue: a machine with node-b's password cannot take node-a's launches. What
key patterns cannot separate (kombu keeps every consumer's unacked messages in one `unacked`
hash; streams are per job, not per node) is covered by the signed reports
(trainyard/nodeauth.py) and the relay's per-job checks.

    python -m trainyard.redis_acl write --dir var --nodes node-a node-b   # passwords + users.acl
    python -m trainyard.redis_acl url --dir var --user node-a --base redis://127.0.0.1:6390/0

Passwords are files `<dir>/credentials/redis-<user>.password` (0600); the ACL file
`<dir>/redis/users.acl` (0600) holds only their SHA-256 (`#<hex>`), as Redis allows.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import secrets
import sys
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from .private import private_dir, write_private

CONTROL_USER = "trainyard-control"
_USER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

# What every node's agent and ranks touch, besides its own queue (trainyard.keys, kombu's Redis transport).
NODE_KEYS = ("control*", "_kombu.binding*", "unacked*", "trainyard:job:*", "trainyard:rdzv:*",
             "trainyard:preempt:*")


def control_rule(password_sha: str) -> str:
    return f"user {CONTROL_USER} on #{password_sha} ~* &* +@all"


def node_rule(node: str, password_sha: str) -> str:
    """A node's user: its own queue and the shared keys above; no admin or dangerous commands
    (CONFIG, FLUSHALL, KEYS, DEBUG, ACL ...) and no pub/sub channels."""
    if not _USER.match(node):
        raise ValueError(f"invalid node name {node!r}")
    keys = " ".join(f"~{k}" for k in (f"node.{node}*", *NODE_KEYS))
    return f"user {node} on #{password_sha} resetkeys {keys} resetchannels +@all -@admin -@dangerous"


def acl_text(passwords: dict[str, str]) -> str:
    """The ACL file for these users (CONTROL_USER and node names -> passwords)."""
    lines = ["user default off resetkeys resetchannels -@all"]
    for user, password in sorted(passwords.items()):
        sha = hashlib.sha256(password.encode()).hexdigest()
        lines.append(control_rule(sha) if user == CONTROL_USER else node_rule(user, sha))
    return "\n".join(lines) + "\n"


def password_path(root: Path, user: str) -> Path:
    return Path(root) / "credentials" / f"redis-{user}.password"


def write(root: Path, nodes: list[str]) -> Path:
    """Create the missing passwords (kept across restarts) and rewrite the ACL file; its path."""
    passwords = {}
    for user in (CONTROL_USER, *nodes):
        path = password_path(root, user)
        private_dir(path.parent)
        if not path.exists():
            write_private(path, secrets.token_urlsafe(32) + "\n")
        passwords[user] = path.read_text().strip()
    acl = private_dir(Path(root) / "redis") / "users.acl"
    write_private(acl, acl_text(passwords))
    return acl


def url_for(base: str, user: str, password: str) -> str:
    """`base` (redis:// or rediss://) with this user's name and password."""
    parts = urlsplit(base)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainyard.redis_acl", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="passwords (kept) and the ACL file (rewritten)")
    w.add_argument("--dir", required=True)
    w.add_argument("--nodes", nargs="*", default=[])
    u = sub.add_parser("url", help="print a user's Redis URL")
    u.add_argument("--dir", required=True)
    u.add_argument("--user", required=True)
    u.add_argument("--base", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "write":
        print(write(Path(args.dir), args.nodes))
    else:
        print(url_for(args.base, args.user, password_path(Path(args.dir), args.user).read_text().strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())


ATTEMPT_USER_PREFIX = "trainyard-attempt-"


def attempt_user(attempt_id: int) -> str:
    """The Redis user of one attempt's ranks (created at launch by the control plane, deleted at its end)."""
    return f"{ATTEMPT_USER_PREFIX}{int(attempt_id)}"


def attempt_rule(attempt_id: int, *, stream: str, preempt_key: str, password_sha: str) -> list[str]:
    """`ACL SETUSER <attempt_user(attempt_id)>` arguments: XADD to its own stream (in MULTI/EXEC),
    GET its own preemption key, the connection handshake; nothing else."""
    return ["reset", "on", f"#{password_sha}", f"%W~{stream}", f"%R~{preempt_key}", "resetchannels", "-@all",
            "+xadd", "+get", "+multi", "+exec", "+ping", "+auth", "+hello", "+client|setname",
            "+select", "+quit", "+reset"]
