"""A job's tags and note: what a valid one is, said once for the JobSpec (`tags`, `note` at submit),
the API's and the page's edits after submit, and the CLI.

A tag is a short lowercase word (`lr-sweep`, `v2.1`, `ablation_b`): the charset reads the same
in a URL's query string (`/jobs/?tag=lr-sweep`), a shell and a chip, so it is never escaped or
quoted. At most MAX_TAGS on a job, so a tag filter stays an indexed lookup (jobs/models/runs.py
JobTag) and a row's chips fit on one line. The note is free text (newlines and tabs allowed, no
other control characters) up to MAX_NOTE_CHARS.
"""
from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator

MAX_TAGS = 16
MAX_TAG_CHARS = 40
MAX_NOTE_CHARS = 2000
TAG_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,39}$"
_TAG = re.compile(TAG_PATTERN)
_NOTE_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def tag_problem(tag: Any) -> str | None:
    """Why `tag` is not a valid tag, or None."""
    if not isinstance(tag, str):
        return f"a tag is a string, got {_shown(tag)}"
    if not _TAG.fullmatch(tag):
        return (f"{_shown(tag)} is not a tag: 1-{MAX_TAG_CHARS} characters of a-z, 0-9, '.', '_' or '-', "
                "starting with a letter or digit")
    return None


def tags_problems(tags: Any) -> list[str]:
    """Every reason `tags` (a list of tags, as submitted or as a job's whole new set) is refused;
    empty when valid."""
    if not isinstance(tags, (list, tuple)):
        return [f"tags is a list of strings, got {_shown(tags)}"]
    problems = [p for p in (tag_problem(t) for t in tags[:MAX_TAGS + 1]) if p]
    if len(tags) > MAX_TAGS:
        problems.append(f"at most {MAX_TAGS} tags on a job, got {len(tags)}")
    seen: set[str] = set()
    dups = sorted({t for t in tags if isinstance(t, str) and (t in seen or seen.add(t))})
    if dups:
        problems.append(f"each tag once: {', '.join(dups[:5])} repeated")
    return problems


def note_problem(note: Any) -> str | None:
    """Why `note` is not a valid note, or None."""
    if not isinstance(note, str):
        return f"the note is a string, got {_shown(note)}"
    if len(note) > MAX_NOTE_CHARS:
        return f"at most {MAX_NOTE_CHARS} characters, got {len(note)}"
    if _NOTE_CONTROL.search(note):
        return "the note must not contain control characters (newlines and tabs are fine)"
    return None


def split_tags(text: str) -> list[str]:
    """Tags typed in one box ("lr-sweep, v2  baseline"): split on commas and whitespace, empty
    parts dropped, order kept, repeats once."""
    return list(dict.fromkeys(t for t in re.split(r"[,\s]+", text) if t))


def _check_tags(value: Any) -> Any:
    problems = tags_problems(value)
    if problems:
        raise ValueError("; ".join(problems))
    return value


def _check_note(value: Any) -> Any:
    problem = note_problem(value)
    if problem:
        raise ValueError(problem)
    return value


# The JobSpec's `tags` and `note` fields (checked before pydantic's own coercion, so the message is ours)
Tags = Annotated[list[str], BeforeValidator(_check_tags)]
Note = Annotated[str, BeforeValidator(_check_note)]
