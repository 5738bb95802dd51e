"""Code bundles: content-addressed user code."""
from __future__ import annotations

from django.conf import settings
from django.db import models


class CodeBundle(models.Model):
    """A code bundle stored at keys.bundle_path(artifact root, digest); rows change through
    jobs.bundles.services (which also writes and deletes the file)."""

    digest = models.CharField(max_length=71, unique=True, help_text='"sha256:<hex>" of the .tar.gz')
    bytes = models.BigIntegerField(help_text="packed size")
    files = models.PositiveIntegerField(help_text="regular files in it")
    file_list = models.JSONField(default=list, help_text="the files' paths (what entrypoint.script may name)")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                              related_name="code_bundles", help_text="who uploaded it first")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True, help_text="last uploaded again or submitted")

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return self.digest
