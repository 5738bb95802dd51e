"""Text no database can hold, refused at the door of every HTTP request (jobs/core/dbtext.py):
PostgreSQL's text and jsonb refuse U+0000, so a NUL in a query parameter that a view compared
against a column (`GET /api/v1/jobs/?node=%00`, found by the API fuzz on PostgreSQL) was a 500
there, and SQLite answered it: one guard here instead of one per parameter per view.

- a NUL in the URL's path: 404 (no job, node, bundle or experiment has one in its name: every name
  came through this door);
- a NUL or a lone surrogate in a query parameter (name or value), or in a page form's field
  (application/x-www-form-urlencoded; an API body is checked by its parser, jobs/core/parsers.py):
  400 naming each parameter, as the API's errors do ({"errors": {"node": ["must not ..."]}}),
  or a plain-text 400 for a page.
Before authentication: the answer says nothing about the data, only about the request's form."""
from __future__ import annotations

from django.http import HttpResponseBadRequest, HttpResponseNotFound, JsonResponse

from jobs.core.dbtext import NUL, shown, text_problem
from trainyard.rules import bounded_errors

FORM = "application/x-www-form-urlencoded"


def _problems(params) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, values in params.lists():
        why = text_problem(name) or next((w for v in values if (w := text_problem(v))), None)
        if why:
            out[shown(name)] = [why]
    return out


class RefuseUnstorableText:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        api = request.path_info.startswith("/api/")
        if NUL in request.path_info:
            if api:
                return JsonResponse({"errors": {"detail": ["not found (the path contains a NUL character)"]}},
                                    status=404)
            return HttpResponseNotFound("not found (the path contains a NUL character)",
                                        content_type="text/plain; charset=utf-8")
        problems = _problems(request.GET)
        if not api and request.method == "POST" and request.content_type == FORM:
            # a page's form (the API's own parsers check its bodies: reading one here would fix the
            # upload handlers before a view, the code upload's, could set its own)
            problems.update(_problems(request.POST))
        if not problems:
            return self.get_response(request)
        problems = bounded_errors(problems)
        if api:
            return JsonResponse({"errors": problems}, status=400)
        return HttpResponseBadRequest("".join(f"{name}: {' '.join(why)}\n" for name, why in problems.items()),
                                      content_type="text/plain; charset=utf-8")
