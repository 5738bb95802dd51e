"""DRF exception handler: every API error is {"errors": {"field.path": ["message"]}} (DESIGN.md 4)."""
from __future__ import annotations

from rest_framework.views import exception_handler as drf_handler


def _flatten(detail, prefix: str, out: dict) -> None:
    if isinstance(detail, dict):
        for k, v in detail.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(detail, list) and detail and all(not isinstance(d, (dict, list)) for d in detail):
        out.setdefault(prefix or "detail", []).extend(str(d) for d in detail)
    elif isinstance(detail, list):
        for i, v in enumerate(detail):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), out)
    else:
        out.setdefault(prefix or "detail", []).append(str(detail))


def exception_handler(exc, context):
    response = drf_handler(exc, context)
    if response is None:
        return None
    data = response.data
    if isinstance(data, dict) and set(data) == {"errors"}:
        return response
    errors: dict[str, list[str]] = {}
    _flatten(data, "", errors)
    response.data = {"errors": errors}
    return response
