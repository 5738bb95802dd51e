"""Redis ACL users for the bus (standard library only; issue 16 section 1, issue 21 section 4): the
one source of every rule `make run`, the tests, `deploy/redis/users.acl` and docs/deploy.md use.
The default user is off, so a client without a password can do nothing (`NOAUTH`).

- **control** (`trainyard-control`): every key, channel and command (`~* &* +@all`). The control
  plane creates and deletes the per-attempt users (ACL SETUSER / DELUSER / SAVE), reads and trims
  every stream (the relay), and runs Celery and the Channels layer; `-@dangerous` would take ACL away.
- **a node** (its name): only what its agent really does, each command on its own keys (a selector
  per purpose; tests/test_bus_acl.py runs every one through ACL DRYRUN, and a real agent under it
  leaves ACL LOG empty):
  its queue `node.<name>` and kombu's priority queues `node.<name>\\x06\\x16{3,6,9}` (BRPOP; RPUSH/LPUSH
  put an unacknowledged message back), anchored: `node.gpu-1` never matches `node.gpu-10`;
  its own unacked bookkeeping (trainyard.keys.node_unacked_keys; kombu's shared `unacked` hash holds
  the control worker's deliveries, which nodes cannot read);
  LPUSH alone on `control` (write-only: no BRPOP, LRANGE or DEL of other nodes' reports; the agent
  publishes through the default exchange, so no binding table is read or written);
  SET/GET on `trainyard:rdzv:*` (names carry the attempt's random token; no SCAN/KEYS to find them);
  PING and MULTI/EXEC/DISCARD/UNWATCH. No channels, no job stream, no preemption key, no scripts
  (EVALSHA could run a Lua loop that blocks Redis: trainyard.celery_redis takes kombu's restore mutex
  without one), no CLIENT subcommand (PAUSE, KILL, LIST; AUTH and HELLO need no permission; redis-py's
  CLIENT SETINFO is not sent by Trainyard's clients, and Redis 7.0 refuses a rule naming it).
- **an attempt** (`trainyard-attempt-<id>`, created at launch by the control plane with
  `attempt_rule`): XADD to its own stream, GET of its own preemption key, MULTI/EXEC, PING.

    python -m trainyard.redis_acl write --dir var --nodes node-a node-b   # passwords + users.acl
    python -m trainyard.redis_acl url --dir var --user node-a --base redis://127.0.0.1:6390/0
    python -m trainyard.redis_acl example > deploy/redis/users.acl        # the deployment example

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

from . import keys
from .private import private_dir, write_private

CONTROL_USER = "trainyard-control"
OPERATOR_USER = "admin"
"""The deployment example's user for the operator's redis-cli on the Redis host (not `make run`)."""
ATTEMPT_USER_PREFIX = "trainyard-attempt-"
RESERVED = {"default", CONTROL_USER, OPERATOR_USER}
_USER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# A key named in a rule must match itself only: no glob character, space, quote or control byte.
_LITERAL_KEY = re.compile(r"^[A-Za-z0-9:._-]{1,200}$")

KOMBU_PRIORITY_SUFFIX = "[^!-~][^!-~][369]"
"""kombu's Redis transport names a queue's priority lists `<queue>\\x06\\x16<step>` (step 3, 6 or 9).
Redis reads an ACL file split on spaces, with no quoting, so the file cannot spell those two bytes;
this glob stands for them: two bytes outside printable ASCII, where every node-name character is,
so `node.gpu-1` + this never matches another node's queue (`node.gpu-10`, `node.gpu-1.b`)."""
RDZV_KEYS = "trainyard:rdzv:*:*"  # <attempt>:<token> (keys.rdzv_port_key)
"""trainyard.keys' rendezvous-port keys; their names carry the attempt's random token."""

HANDSHAKE = ["+ping"]
"""What redis-py and kombu send besides AUTH/HELLO (which need no permission): PING when a channel
opens and for idle-connection health checks. No CLIENT subcommand (SETINFO is not sent, see above)."""
TRANSACTION = ["+multi", "+exec", "+discard"]


def _check_user(name: str) -> str:
    if not _USER.match(name or "") or name in RESERVED or name.startswith(ATTEMPT_USER_PREFIX):
        raise ValueError(f"invalid node name {name!r} (1-64 letters, digits, '.', '_', '-'; not "
                         f"{sorted(RESERVED)} nor {ATTEMPT_USER_PREFIX}*)")
    return name


def _literal(key: str) -> str:
    if not _LITERAL_KEY.match(key or ""):
        raise ValueError(f"{key!r} is not a literal key name an ACL pattern can hold")
    return key


def _selector(*rules: str) -> str:
    return "(" + " ".join(rules) + ")"


def control_rule(password_sha: str) -> list[str]:
    return ["reset", "on", f"#{password_sha}", "~*", "&*", "+@all"]


def operator_rule(password_sha: str) -> list[str]:
    return ["reset", "on", f"#{password_sha}", "~*", "&*", "+@all"]


def default_rule() -> list[str]:
    return ["reset", "off", "resetchannels", "-@all"]


def node_rule(node: str, password_sha: str) -> list[str]:
    """The ACL SETUSER arguments of a node's user (see the module docstring for each part)."""
    queue = keys.node_queue(_check_user(node))
    unacked = keys.node_unacked_keys(node)
    return [
        "reset", "on", f"#{password_sha}", "resetchannels", "-@all", *HANDSHAKE, *TRANSACTION, "+unwatch",
        f"~{queue}", f"~{queue}{KOMBU_PRIORITY_SUFFIX}", "+brpop", "+rpush", "+lpush",
        _selector(*(f"~{unacked[k]}" for k in ("unacked_key", "unacked_index_key", "unacked_mutex_key")),
                  "+hset", "+hget", "+hdel", "+zadd", "+zrem", "+zrange", "+watch", "+set", "+get", "+del"),
        _selector(f"%W~{keys.CONTROL_QUEUE}", "+lpush"),
        _selector(f"~{RDZV_KEYS}", "+set", "+get"),
    ]


def attempt_user(attempt_id: int) -> str:
    """The Redis user of one attempt's ranks (created at launch, deleted at the attempt's end)."""
    return f"{ATTEMPT_USER_PREFIX}{int(attempt_id)}"


def attempt_rule(attempt_id: int, *, stream: str, preempt_key: str, password_sha: str) -> list[str]:
    """The ACL SETUSER arguments of attempt `attempt_id`'s user: XADD to its own stream (write-only:
    it reads nothing back), GET of its own preemption key (read-only: it cannot clear or forge a
    fence), MULTI/EXEC around its pipelined XADDs, PING. Nothing else: no other key, no channel."""
    attempt_user(attempt_id)  # an int
    if not re.fullmatch(r"[0-9a-f]{64}", password_sha or ""):
        raise ValueError("password_sha must be a SHA-256 in lowercase hex")
    return ["reset", "on", f"#{password_sha}", "resetchannels", "-@all", *HANDSHAKE, *TRANSACTION,
            f"%W~{_literal(stream)}", f"%R~{_literal(preempt_key)}", "+xadd", "+get"]


# ---------------------------------------------------------------- the ACL file

def _file_line(user: str, rule: list[str]) -> str:
    """One line of the ACL file. Redis splits it on spaces with no quoting (a selector's parts are
    joined back), so every token must be printable ASCII without a space, as every rule here is."""
    for token in rule:
        inner = token[1:-1].split(" ") if token.startswith("(") and token.endswith(")") else [token]
        if not all(re.fullmatch(r"[!-~]+", t) for t in inner):
            raise ValueError(f"{token!r} cannot be written to an ACL file")
    return f"user {user} " + " ".join(rule)


def acl_file(shas: dict[str, str], *, operator_sha: str | None = None) -> str:
    """The ACL file for these users (CONTROL_USER and node names -> password SHA-256)."""
    lines = [_file_line("default", default_rule())]
    if operator_sha is not None:
        lines.append(_file_line(OPERATOR_USER, operator_rule(operator_sha)))
    for user, sha in sorted(shas.items()):
        lines.append(_file_line(user, control_rule(sha) if user == CONTROL_USER else node_rule(user, sha)))
    return "\n".join(lines) + "\n"


def acl_text(passwords: dict[str, str]) -> str:
    """The ACL file for these users (CONTROL_USER and node names -> passwords)."""
    return acl_file({u: hashlib.sha256(p.encode()).hexdigest() for u, p in passwords.items()})


def example_text() -> str:
    """deploy/redis/users.acl: the deployment's users with placeholders for their hashes (the
    operator, the control plane, one node `gpu-1`; docs/deploy.md section 2.2)."""
    return acl_file({CONTROL_USER: "<sha256-of-the-control-plane-password>", "gpu-1": "<sha256-of-gpu-1-password>"},
                    operator_sha="<sha256-of-the-operator-password>")


def password_path(root: Path, user: str) -> Path:
    return Path(root) / "credentials" / f"redis-{user}.password"


def write(root: Path, nodes: list[str]) -> Path:
    """Create the missing passwords (kept across restarts) and rewrite the ACL file; its path."""
    for node in nodes:
        _check_user(node)
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
    sub.add_parser("example", help="print deploy/redis/users.acl (placeholders for the hashes)")
    args = ap.parse_args(argv)
    if args.cmd == "write":
        print(write(Path(args.dir), args.nodes))
    elif args.cmd == "example":
        sys.stdout.write(example_text())
    else:
        print(url_for(args.base, args.user, password_path(Path(args.dir), args.user).read_text().strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
