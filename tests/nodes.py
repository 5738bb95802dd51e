"""Test helper: a node as a registered agent would bring it up (issue 16: heartbeats from
unregistered nodes are refused, so a test registers its nodes as staff would, then beats)."""
from __future__ import annotations


def node_up(payload: dict):
    """Register payload's node (as `manage.py node_add` does) unless it is, then apply the heartbeat;
    returns services.node_heartbeat's (node, orphans)."""
    from jobs import services
    from jobs.models import Node

    if not Node.objects.filter(name=payload["name"]).exclude(credential_digest="").exists():
        services.node_add(payload["name"], slots=payload["slots"], address=payload["address"],
                          labels=payload.get("labels"))
    from trainyard.launch import Heartbeat

    return services.node_heartbeat(Heartbeat.model_validate(payload))


def credential(name: str, *, slots: int = 2, address: str = "127.0.0.1") -> str:
    """Node `name`'s credential, registering it first if needed (what its agent's file holds)."""
    from jobs.models import Node
    from jobs.fleet.services import identity
    from trainyard import nodeauth

    node = Node.objects.filter(name=name).exclude(credential_digest="").first()
    if node is None:
        return identity.node_add(name, slots=slots, address=address)[1]
    return nodeauth.derive_credential(identity.master_key(), name, node.credential_salt)


def signed(task: str, body: dict, *, node: str = "node-a", ts: float | None = None) -> dict:
    """`body` as node's agent sends it for `task`: a Signed envelope under its credential."""
    import time

    from trainyard import nodeauth

    return nodeauth.seal(credential(node), node, task, body, time.time() if ts is None else ts)
