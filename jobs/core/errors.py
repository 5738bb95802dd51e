"""The control plane's domain errors: what a service refuses and why, without knowing HTTP.

Services raise these; jobs.core.api_errors.exception_handler turns each into its HTTP status with the
API's one error body, {"errors": {"field.path": ["message"]}}, and the HTML views show the same
field errors on their forms. A JobSpec that fails validation raises trainyard.spec.SpecError
(the contract package knows nothing of this module); the handler maps it to 400 like InvalidInput.
"""
from __future__ import annotations


class DomainError(Exception):
    """Base of every refusal a service makes. `errors` maps a field path ("0.max_slots", or
    "detail" when no field is to blame) to its messages; `status_code` is the HTTP status the
    API answers with."""

    status_code = 400
    field = "detail"

    def __init__(self, errors: dict[str, list[str]] | str, *, field: str | None = None):
        if isinstance(errors, str):
            errors = {field or self.field: [errors]}
        super().__init__("; ".join(f"{k}: {' '.join(v)}" for k, v in errors.items()))
        self.errors = errors

    @property
    def message(self) -> str:
        """The first message alone, for the HTML views' flash messages."""
        return next(iter(self.errors.values()))[0]


class InvalidInput(DomainError):
    """400: a request's fields are wrong (the field paths say which)."""


class QuotaError(InvalidInput):
    """400: a quota update's entries are malformed or name a team/user that does not exist."""


class NodeActionError(InvalidInput):
    """400: an unknown node action, or a drain without a valid mode ("finish" or "preempt")."""


class RollbackCheckpointError(InvalidInput):
    """400: a rollback names no checkpoint of this job, or one whose files are gone."""

    field = "checkpoint"


class Forbidden(DomainError):
    """403: the user may see the object but not do this to it (owner or staff only)."""

    status_code = 403


class NotFound(DomainError):
    """404: the object named in the request does not exist (or is not visible)."""

    status_code = 404


class PayloadTooLarge(DomainError):
    """413: an upload over a size limit (a code bundle's packed, unpacked or file-count limit)."""

    status_code = 413


class Conflict(DomainError):
    """409: the request is valid but the object's current state refuses it."""

    status_code = 409


class TransitionError(Conflict):
    """409: a job or checkpoint is in a state this transition cannot leave (cancel a finished
    job, roll back a job being cancelled, pin a deleted checkpoint). The field defaults to
    "status"; a checkpoint's refusal names "checkpoint"."""

    field = "status"


class TooManyRequests(DomainError):
    """429: a per-user limit is reached (queued jobs: TRAINYARD_MAX_QUEUED_JOBS_PER_USER); the
    message says which limit and how to get under it."""

    status_code = 429


class Unavailable(DomainError):
    """503: the server cannot serve this now through no fault of the request (a storage directory
    found replaced by a link, refused rather than followed)."""

    status_code = 503
