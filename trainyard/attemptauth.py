"""Per-attempt secrets and the proof a checkpoint manifest carries (standard library only; issue 21
section 3).

Every attempt gets, in its sealed Launch (trainyard.launch), three secrets derived by the control
plane from its master key (TRAINYARD_NODE_KEY) and a random salt kept on the attempt's row (so a
copy of the database alone derives nothing, and a launch sent again carries the same ones):

- `redis_password`: of the attempt's own Redis ACL user (trainyard.redis_acl.attempt_user), which
  may only XADD to the attempt's stream (trainyard.keys.attempt_stream) and GET its preemption key.
  The ranks, and the agents forwarding the attempt's logs, write with it; the stream an entry
  arrived on is then the proof of the attempt that wrote it.
- `proof_key`: the ranks sign their checkpoint manifests with it (`manifest_proof`); the control
  plane registers or resumes from a checkpoint only if its manifest's proof verifies with the key of
  the attempt it names, so a directory planted by anything but that attempt's own ranks never counts.
- `rdzv_token`: part of the rendezvous-port key's name (trainyard.keys.rdzv_port_key), so no node
  outside the attempt can name the key and plant a port in it.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from typing import Any

PROOF_FIELD = "proof"


@dataclass(frozen=True)
class AttemptSecrets:
    redis_password: str
    proof_key: str
    rdzv_token: str


def new_salt() -> str:
    """A fresh salt for an attempt's row (128 bits, hex)."""
    return secrets.token_hex(16)


def derive(master_key: bytes, attempt_id: int, salt: str) -> AttemptSecrets:
    """The attempt's secrets: HMAC-SHA256 of the master key over (attempt, salt), one per purpose."""
    if not salt:
        raise ValueError(f"attempt {attempt_id} has no salt: its secrets cannot be derived")
    base = hmac.new(master_key, f"trainyard-attempt\0{int(attempt_id)}\0{salt}".encode(), hashlib.sha256).digest()

    def part(purpose: str) -> bytes:
        return hmac.new(base, purpose.encode(), hashlib.sha256).digest()

    return AttemptSecrets(
        redis_password=base64.urlsafe_b64encode(part("redis")).rstrip(b"=").decode(),
        proof_key=part("manifest").hex(), rdzv_token=part("rdzv").hex()[:32])


def _canonical(manifest: dict[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != PROOF_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def manifest_proof(proof_key: str, manifest: dict[str, Any]) -> str:
    """hex HMAC-SHA256 of the manifest (every field but the proof, canonical JSON) with the key."""
    return hmac.new(bytes.fromhex(proof_key), _canonical(manifest), hashlib.sha256).hexdigest()


def manifest_proof_ok(proof_key: str, manifest: dict[str, Any]) -> bool:
    """Whether the manifest carries a proof made with this key over exactly its other fields."""
    proof = manifest.get(PROOF_FIELD)
    if not isinstance(proof, str):
        return False
    try:
        expected = manifest_proof(proof_key, manifest)
    except (TypeError, ValueError):  # a value JSON cannot carry (nan): not what a rank wrote
        return False
    return hmac.compare_digest(proof, expected)
