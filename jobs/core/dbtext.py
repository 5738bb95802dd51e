"""Text from outside (a rank's output in an agent's exit report, a runtime event's fields) made
storable on every database. PostgreSQL's text and jsonb cannot hold U+0000 (SQLite can): one NUL
in a rank's log tail made the exit report's UPDATE raise, so the attempt never ended; one in an
event's field lost the relay's whole batch. NUL becomes U+FFFD, the replacement character, in
every string, key or value, at any depth; nothing else changes. Input a user typed is refused
instead, with the reason (`text_problem`). No Django here."""
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
