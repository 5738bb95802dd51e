"""Text from outside (a rank's output in an agent's exit report, a runtime event's fields) made
storable on every database. PostgreSQL's text and jsonb cannot hold U+0000 (SQLite can): one NUL
in a rank's log tail made the exit report's UPDATE raise, so the attempt never ended; one in an
event's field lost the relay's whole batch. NUL becomes U+FFFD, the replacement character, in
every string, key or value, at any depth; nothing else changes. Input a user typed is refused
instead, with the reason (`text_problem`, `text_problems`): at the edge, once for every request
(jobs/core/middleware.py for the URL, its query and a form's fields; jobs/core/parsers.py for an
API body), so no view can pass such a value to a query. No Django here."""
from __future__ import annotations

NUL, REPLACEMENT = "\x00", "\ufffd"


def text_problem(text: str) -> str | None:
    """Why `text` (a value a user typed, compared against the database) cannot be, or None: a NUL
    (PostgreSQL's text refuses it, a 500 there) or a lone surrogate (not encodable as UTF-8)."""
    if NUL in text:
        return "must not contain NUL (\\u0000) characters"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "must be valid Unicode (no lone surrogates)"
    return None


def text_problems(value, path: str = "", *, limit: int = 10) -> dict[str, list[str]]:
    """Field path ("spec.name", "tags.0"; "detail" for a bare value) -> [why], for each string in a
    JSON-like `value`, dict keys included, that `text_problem` refuses: at most `limit` paths, and
    the walk stops there (a body of a million bad strings costs no more than ten)."""
    out: dict[str, list[str]] = {}

    def walk(v, at: str) -> None:
        if len(out) >= limit:
            return
        if isinstance(v, str):
            if why := text_problem(v):
                out[at or "detail"] = [why]
        elif isinstance(v, dict):
            for k, item in v.items():
                here = f"{at}.{k}" if at else str(k)
                if isinstance(k, str) and (why := text_problem(k)):
                    out[shown(here)] = [f"this key {why}"]
                else:
                    walk(item, here)
        elif isinstance(v, (list, tuple)):
            for i, item in enumerate(v):
                walk(item, f"{at}.{i}" if at else str(i))

    walk(value, path)
    return out


def shown(text: str) -> str:
    """`text` safe to quote back in a response: a NUL as the six characters \\u0000, a lone
    surrogate as its escape (\\udb8d)."""
    return text.replace(NUL, "\\u0000").encode("utf-8", "backslashreplace").decode("utf-8")


def storable(value):
    """A copy of `value` (JSON-like: dicts, lists, tuples, scalars) with every NUL in its strings,
    dict keys included, replaced by U+FFFD."""
    if isinstance(value, str):
        return value.replace(NUL, REPLACEMENT) if NUL in value else value
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(storable(v) for v in value)
    return value
