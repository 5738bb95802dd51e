"""API tokens, stored hashed (issue 15, section 3): `Authorization: Token <key>` for the API and
for websockets without an Origin (jobs/access/ws_auth.py). Issuing one is jobs/access/services.py's.

A key is 32 random bytes (urlsafe base64); the database keeps only its SHA-256 (models.ApiToken).
A presented key is hashed and looked up by digest, and the digest compared in constant time.
The hash is deliberately fast: a key has 256 bits of entropy, so there is nothing for a slow hash
to protect, and every API request pays for it. Before, DRF's authtoken kept every key in clear
text, so a copy of the database (or a backup) was every user's credentials.

Revoking (deleting a token, deactivating or deleting a user) closes the websockets it opened:
every authenticated socket joins the groups `user_group(user)` and, when a token opened it,
`token_group(token)` (jobs/runs/consumers.py); jobs/signals.py sends `auth.revoked` to them.
"""
from __future__ import annotations

import hashlib
import hmac

from rest_framework.authentication import TokenAuthentication
from rest_framework.exceptions import AuthenticationFailed

MAX_KEY_LENGTH = 200  # longer is no key of ours: refused before hashing
REVOKED_CLOSE_CODE = 4401


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def lookup(key: str):
    """The ApiToken (with its user) whose key this is, else None."""
    from jobs.models import ApiToken

    if not key or len(key) > MAX_KEY_LENGTH:
        return None
    wanted = digest(key)
    token = ApiToken.objects.select_related("user").filter(digest=wanted).first()
    if token is None or not hmac.compare_digest(token.digest, wanted):
        return None
    return token


def still_valid(user_id: int, token_id: int | None) -> bool:
    """The user is still active and (for a token's socket) the token still exists."""
    from django.contrib.auth import get_user_model

    from jobs.models import ApiToken

    if token_id is not None:
        return ApiToken.objects.filter(pk=token_id, user_id=user_id, user__is_active=True).exists()
    return get_user_model().objects.filter(pk=user_id, is_active=True).exists()


def user_group(user_id: int) -> str:
    return f"auth.user.{int(user_id)}"


def token_group(token_id: int) -> str:
    return f"auth.token.{int(token_id)}"


class HashedTokenAuthentication(TokenAuthentication):
    """DRF's `Token <key>` header, checked against the hashed keys."""

    def authenticate_credentials(self, key):
        token = lookup(key)
        if token is None:
            raise AuthenticationFailed("Invalid token.")
        if not token.user.is_active:
            raise AuthenticationFailed("User inactive or deleted.")
        return token.user, token
