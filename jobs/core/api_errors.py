"""The one DRF exception handler: every API error is {"errors": {"field.path": ["message"]}}
(docs/architecture.md, section 7), with the status its kind says.

Domain errors (jobs/core/errors.py) carry their field paths and status (400 invalid input, 403
forbidden, 404 not found, 409 conflict); a JobSpec that fails validation (trainyard.spec.SpecError)
is a 400 with its field paths, and so is bad planner input (PlanInputError); DRF's own errors (parse errors, authentication, its NotFound and
ValidationError) keep their status and get their detail flattened into field paths. Views raise;
none of them builds an error response by hand.
"""
from __future__ import annotations

from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_handler
from rest_framework.views import set_rollback

from jobs.core.errors import DomainError
from trainyard.plan import PlanInputError
from trainyard.rules import bounded_errors
from trainyard.spec import SpecError


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
    """settings.REST_FRAMEWORK["EXCEPTION_HANDLER"]: None (a 500) for anything not an API error."""
    if isinstance(exc, (DomainError, SpecError, PlanInputError)):
        set_rollback()
        return Response({"errors": bounded_errors(exc.errors)}, status=getattr(exc, "status_code", 400))
    response = drf_handler(exc, context)
    if response is None:
        return None
    data = response.data
    if isinstance(data, dict) and set(data) == {"errors"} and isinstance(data["errors"], dict):
        response.data = {"errors": bounded_errors(data["errors"])}
        return response
    errors: dict[str, list[str]] = {}
    _flatten(data, "", errors)
    # Whatever the error quotes back (a parse error's excerpt, a hostile value) stays small.
    response.data = {"errors": bounded_errors(errors)}
    return response
