"""What every page's template (templates/base.html) is given besides the request and the user."""
from __future__ import annotations

from trainyard import status

# The pages' JavaScript reads which job statuses are final from this (static/js/util.js TERMINAL),
# written into each page by base.html's json_script: one list, trainyard/status.py, and no request.
_JOB_STATUSES = {"terminal": list(status.TERMINAL)}


def job_statuses(request) -> dict:
    return {"job_statuses": _JOB_STATUSES}
