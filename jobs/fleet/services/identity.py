"""Node identity (issue 16, section 1): staff register nodes, unknown nodes become join requests,
every report is opened here (signature, sender, task) before a service applies it, and what is
refused is a counted security event.

Before, the control queue took any heartbeat or report at its word: `node_heartbeat` upserted a
node from whatever name, address and slots arrived, so anyone who could reach Redis could add a
node, move a node's rendezvous address, or offer 4,096 slots on a 2-slot machine.
"""
from __future__ import annotations

import logging
import re
import secrets
import time

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from pydantic import ValidationError

from trainyard import nodeauth
from trainyard.launch import HEARTBEAT_TASK, Heartbeat, Signed

from jobs.core.errors import InvalidInput
from jobs.models import Node, NodeJoinRequest, SecurityEvent

log = logging.getLogger("trainyard.security")

# A node's name becomes its Celery queue (node.<name>) and a path component of its run directory.
NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def master_key() -> bytes:
    return settings.TRAINYARD_NODE_KEY.encode()


def node_add(name: str, *, slots: int, address: str = "", labels: dict | None = None,
             reissue: bool = False) -> tuple[Node, str]:
    """Register (approve) a node and return it with its credential, which is shown once: only its
    salt and SHA-256 are stored. An already registered node is refused unless `reissue` (a new
    credential; the old one stops signing). Until its first heartbeat the node is LOST (not
    schedulable); `slots` caps what its heartbeats may offer, `address` is its rendezvous address
    (empty: the first signed heartbeat's)."""
    errors: dict[str, list[str]] = {}
    if not NODE_NAME.match(name or ""):
        errors["name"] = ["1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"]
    if not isinstance(slots, int) or slots < 1:
        errors["slots"] = ["must be at least 1"]
    if errors:
        raise InvalidInput(errors)
    salt = secrets.token_hex(16)
    credential = nodeauth.derive_credential(master_key(), name, salt)
    fields = {"credential_salt": salt, "credential_digest": nodeauth.fingerprint(credential),
              "slots_approved": slots, "slots": slots}
    if address:
        fields["address"] = address
    if labels is not None:
        fields["labels"] = labels
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(name=name).first()
        if node is not None and node.credential_digest and not reissue:
            raise InvalidInput({"name": [f"node {name} is already registered; reissue its credential to replace "
                                         "it (the old one stops working)"]})
        if node is None:
            node = Node.objects.create(name=name, status=Node.Status.LOST, **{"address": "", **fields})
        else:
            Node.objects.filter(pk=node.pk).update(**fields)
            node.refresh_from_db()
        NodeJoinRequest.objects.filter(name=name).delete()
    log.info("node %s registered (%s slots, address %s)%s", name, slots, address or "from its first heartbeat",
             " with a new credential" if reissue else "")
    return node, credential


OTHER_SOURCES = "(other sources)"
"""The source of a kind's overflow row: not a node name (NODE_NAME refuses the parentheses)."""
_FULL_RECHECK_S = 5.0
_full_seen_at = -_FULL_RECHECK_S
_LOG_WINDOW_S = 60.0
_LOG_PER_WINDOW = 20
_log_windows: dict[str, list] = {}  # kind -> [window start, warnings logged, refusals not logged]


def security_event(kind: str, node: str, detail: str = "", *, registered: bool | None = None) -> None:
    """Log a refused report and count it: one row per (kind, source), its count and last detail.

    A source is the node name the report claims, which anyone who can write the control queue
    makes up. A registered node always has its own row; other sources get one only while fewer
    than TRAINYARD_SECURITY_EVENT_SOURCES_MAX rows of unregistered sources exist, and after that
    are counted in their kind's OTHER_SOURCES row (its detail names the latest). So the table
    stays under (registered nodes + that cap + 1) rows per kind, however many names a flood makes
    up, and `trainyard_security_events_total` still counts every refusal. The warnings are
    rate-limited per kind (_log). `registered`: whether the source is a registered node, when the
    caller knows (None: looked up)."""
    node, detail = str(node)[:64], str(detail)[:500]
    _log(kind, node, detail)
    if SecurityEvent.objects.filter(kind=kind, node=node).update(count=F("count") + 1, detail=detail):
        return
    if _sources_full() and not (registered if registered is not None else Node.objects.filter(name=node).exists()):
        node, detail = OTHER_SOURCES, f"{node}: {detail}"[:500]
        if SecurityEvent.objects.filter(kind=kind, node=node).update(count=F("count") + 1, detail=detail):
            return
    try:
        with transaction.atomic():
            SecurityEvent.objects.create(kind=kind, node=node, detail=detail, count=1)
    except IntegrityError:  # created concurrently
        SecurityEvent.objects.filter(kind=kind, node=node).update(count=F("count") + 1, detail=detail)


def _sources_full() -> bool:
    """Whether unregistered sources have all the rows they may have. Once they do, that is believed
    for _FULL_RECHECK_S without counting again (a flood costs two queries per refusal, not three)."""
    global _full_seen_at
    if time.monotonic() - _full_seen_at < _FULL_RECHECK_S:
        return True
    unregistered = SecurityEvent.objects.exclude(node__in=Node.objects.values("name")).exclude(node=OTHER_SOURCES)
    if unregistered.count() < settings.TRAINYARD_SECURITY_EVENT_SOURCES_MAX:
        return False
    _full_seen_at = time.monotonic()
    return True


def _log(kind: str, node: str, detail: str) -> None:
    """At most _LOG_PER_WINDOW warnings per kind and minute in this process; the rest are summed in
    one line when the next minute starts (a flood of refusals does not flood the log either)."""
    now = time.monotonic()
    window = _log_windows.setdefault(kind, [now, 0, 0])  # start, logged, not logged
    if now - window[0] >= _LOG_WINDOW_S:
        if window[2]:
            log.warning("security: %d more %s refusals in the last %.0f s were not logged one by one", window[2],
                        kind, now - window[0])
        window[:] = [now, 0, 0]
    if window[1] >= _LOG_PER_WINDOW:
        window[2] += 1
        return
    window[1] += 1
    log.warning("security: %s from node %r refused: %s", kind, node, detail)


def join_request(name: str, body: dict) -> None:
    """A heartbeat from a node nobody registered: refused, kept for staff to approve."""
    try:
        beat = Heartbeat.model_validate(body)
    except ValidationError as exc:
        security_event("malformed", name, f"unregistered node's heartbeat: {exc.error_count()} errors")
        return
    join_requested(name, beat)


def join_requested(name: str, beat: Heartbeat) -> None:
    """Keep a validated heartbeat of unregistered node `name` as a join request for staff."""
    fields = {"address": beat.address[:255], "slots": max(0, beat.slots), "labels": beat.labels}
    if NodeJoinRequest.objects.filter(name=name).update(heartbeats=F("heartbeats") + 1, **fields):
        return
    if NodeJoinRequest.objects.count() >= settings.TRAINYARD_JOIN_REQUESTS_MAX or not NODE_NAME.match(name):
        security_event("join_refused", name, "too many join requests pending, or an invalid node name")
        return
    try:
        with transaction.atomic():
            NodeJoinRequest.objects.create(name=name, heartbeats=1, **fields)
    except IntegrityError:
        return
    log.warning("node %r (%s, %s slots) is not registered: its heartbeat is refused and shown to staff as a "
                "join request", name, beat.address, beat.slots)


def report_open(envelope: object, *, task: str) -> tuple[Node, dict] | None:
    """The signing node and the body of a report, or None when it is refused (and counted): not an
    envelope, signed for another task, from an unregistered node (a heartbeat becomes a join
    request), a signature that is not the node's credential's, or a heartbeat older than
    TRAINYARD_HEARTBEAT_MAX_AGE_S."""
    try:
        env = Signed.model_validate(envelope)
    except ValidationError as exc:
        name = envelope.get("node", "?") if isinstance(envelope, dict) else "?"
        security_event("malformed", str(name), f"{task}: not a signed report ({exc.error_count()} errors)")
        return None
    if env.task != task:
        security_event("wrong_task", env.node, f"signed for {env.task[:100]}, delivered as {task}")
        return None
    node = Node.objects.filter(name=env.node).first()
    if node is None or not node.credential_digest:
        if task == HEARTBEAT_TASK:
            join_request(env.node, env.body)
        else:
            security_event("unknown_node", env.node, f"{task} from a node with no registered credential",
                           registered=False)
        return None
    credential = nodeauth.derive_credential(master_key(), node.name, node.credential_salt)
    if nodeauth.fingerprint(credential) != node.credential_digest:
        log.error("node %s: its stored credential does not derive from TRAINYARD_NODE_KEY (was the key or "
                  "SECRET_KEY changed?): reissue it with manage.py node_add %s --reissue", node.name, node.name)
    if not nodeauth.signature_ok(credential, envelope if isinstance(envelope, dict) else {}):
        security_event("bad_signature", env.node, f"{task}: the signature is not this node's credential's")
        return None
    if task == HEARTBEAT_TASK and abs(time.time() - env.ts) > settings.TRAINYARD_HEARTBEAT_MAX_AGE_S:
        security_event("stale", env.node, f"heartbeat signed {time.time() - env.ts:.0f} s ago")
        return None
    return node, env.body
