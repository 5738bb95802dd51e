"""API tokens (stored as their SHA-256)."""
from __future__ import annotations

from django.conf import settings
from django.db import models


class ApiToken(models.Model):
    """An API token (`Authorization: Token <key>`), stored as the SHA-256 of its key: the key is shown
    once when created (`manage.py api_token USER`, POST /api/v1/auth/token/) and a copy of the
    database authenticates nobody. A fast hash is right here: keys are 256 random bits, nothing to
    guess (jobs/access/tokens.py). Deleting a row revokes the key and closes its websockets."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    digest = models.CharField(max_length=64, unique=True, help_text="SHA-256 of the key, hex")
    prefix = models.CharField(max_length=8, help_text="the key's first characters, to tell tokens apart")
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user})"
