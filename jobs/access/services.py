"""The access domain's writes: issuing API tokens (revoking is deleting the row, in the admin
or by deactivating the user; jobs/signals.py closes the sockets it opened)."""
from __future__ import annotations

import secrets

from jobs.access.tokens import digest
from jobs.models import ApiToken


def token_issue(user) -> str:
    """Create a new API token for `user` and return its key: the only time the key exists in
    clear (the database keeps its digest and the first 8 characters to tell tokens apart)."""
    key = secrets.token_urlsafe(32)
    ApiToken.objects.create(user=user, digest=digest(key), prefix=key[:8])
    return key
