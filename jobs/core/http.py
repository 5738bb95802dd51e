"""Small helpers the API views share: staff checks and bounded integer query parameters.
"""
from __future__ import annotations
from rest_framework.exceptions import ValidationError
from trainyard.textdoc import echo
from jobs.core.errors import Forbidden


def require_staff(request, what: str) -> None:
    if not request.user.is_staff:
        raise Forbidden(f"only staff may {what}")


# The database's integers are 64-bit: a larger parameter would raise OverflowError in the query (a 500).
MAX_DB_INT = 2**63 - 1


def int_param(request, name: str, *, minimum: int = 0, maximum: int = MAX_DB_INT, default=None):
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return default
    value = None
    if len(raw) <= 20:  # int() of a 100,000-digit string costs; 20 digits hold every valid value
        try:
            value = int(raw)
        except ValueError:
            pass
    if value is None:
        raise ValidationError({name: [f"must be a whole number from {minimum} to {maximum}, got {echo(raw)}"]})
    if not minimum <= value <= maximum:
        raise ValidationError({name: [f"must be between {minimum} and {maximum}"]})
    return value
