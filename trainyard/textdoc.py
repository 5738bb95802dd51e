"""Untrusted JSON/YAML text -> plain data, with the costs bounded before and while parsing.

A JobSpec (or a plan request) arrives as text from the submit form, the API and the CLI. Parsed
naively, a few hundred bytes can cost the server gigabytes: a YAML "billion laughs" (anchors and
aliases nested 9 wide, 9 deep) expands a 341-byte document into 9**9 references, and the error
that echoed it back was 50 MB of text after 3 s. So, here and nowhere else:

- the raw size is checked first (`MAX_DOC_BYTES`, on the UTF-8 bytes), before any parser runs;
- YAML anchors and aliases are refused as the composer meets them (no expansion ever happens),
  and so are tags other than the core schema's (safe_load already refuses objects);
- nesting deeper than `MAX_DEPTH` is refused while composing (YAML) or right after decoding
  (JSON, checked iteratively), far below where a recursive consumer would blow Python's stack;
- an integer literal longer than Python's int/str limit (4,300 digits) is a clear error, not a
  ValueError escaping as a 500.

`DocError` carries one short message; callers turn it into their own field error.
"""
from __future__ import annotations

import json
from typing import Any

import yaml

MAX_DOC_BYTES = 256 * 1024  # a JobSpec is ~1 KB; its largest part, `config`, is capped at 64 KiB
MAX_DEPTH = 48  # objects/lists; the spec's own deepest part (`config`) is capped at 32
MAX_ECHO_CHARS = 80  # an untrusted value quoted back in an error message


class DocError(ValueError):
    """The text is not an acceptable JSON/YAML document (too big, too deep, aliases, syntax).
    For a syntax error `where` is " at line L, column C" (or "") and `problem` the parser's word."""

    def __init__(self, message: str, *, where: str | None = None, problem: str = ""):
        super().__init__(message)
        self.where, self.problem = where, problem


def whole_number(text: str, max_digits: int = 18) -> int | None:
    """`text` as a non-negative integer if it is 1..max_digits ASCII digits, else None. Not
    `text.isdigit()` then `int(text)`: "²".isdigit() is true and int("²") raises (a 500 for a query
    parameter), and 18 digits keep every value inside the database's 64-bit integers."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= max_digits else None


def echo(value: Any, limit: int = MAX_ECHO_CHARS) -> str:
    """`repr(value)` for an error message, at most `limit` characters: never the whole of an
    untrusted value (a list of a million items, a 100 KB string)."""
    if isinstance(value, (list, dict, tuple, set)):
        head = f"a {type(value).__name__} of {len(value)} items"
        return head if len(head) <= limit else head[:limit]
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value) if not isinstance(value, str) else repr(value[: limit + 1])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def nesting_depth(v: Any, limit: int = MAX_DEPTH) -> int:
    """Levels of dicts/lists in `v`, counted no further than limit + 1. Iterative, so a hostile
    document cannot exhaust the recursion this check protects (also the spec's `config` bound)."""
    deepest, stack = 0, [(v, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            deepest = max(deepest, d)
            if d <= limit:
                stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return deepest


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses anchors and aliases and nesting past MAX_DEPTH as it composes."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            mark = event.start_mark
            raise DocError(f"YAML anchors and aliases (&name, *name) are not accepted "
                           f"(line {mark.line + 1}, column {mark.column + 1}); write each value out")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise DocError(f"the document nests too deeply (more than {MAX_DEPTH} levels of objects and lists)")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _check_size(text: str) -> None:
    # len(text) is a lower bound on the bytes: cheap rejection of the clearly huge first.
    if len(text) > MAX_DOC_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_DOC_BYTES:
        raise DocError(f"the document is larger than {MAX_DOC_BYTES // 1024} KiB")


def load_yaml(text: str) -> Any:
    """YAML (JSON is YAML) `text` as plain data, or DocError with one short message."""
    _check_size(text)
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except DocError:
        raise
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = str(getattr(exc, "problem", None) or exc)[:200]
        raise DocError(f"neither valid JSON nor YAML{where}: {problem}", where=where, problem=problem) from None
    except ValueError:  # an int past Python's int/str digit limit
        raise DocError("a number has too many digits (more than 4300)") from None
    except RecursionError:
        raise DocError(f"the document nests too deeply (more than {MAX_DEPTH} levels of objects and lists)") from None


def load_json(text: str) -> Any:
    """JSON `text` as plain data, or DocError; a plain ValueError when it is not JSON at all."""
    _check_size(text)
    try:
        data = json.loads(text)
    except RecursionError:
        raise DocError(f"the document nests too deeply (more than {MAX_DEPTH} levels of objects and lists)") from None
    except ValueError as exc:
        if "digits" in str(exc):  # "Exceeds the limit (4300 digits) for integer string conversion"
            raise DocError("a number has too many digits (more than 4300)") from None
        raise
    check_depth(data)
    return data


def check_depth(data: Any) -> None:
    """DocError when `data` (already parsed) nests more than MAX_DEPTH levels."""
    if nesting_depth(data) > MAX_DEPTH:
        raise DocError(f"the document nests too deeply (more than {MAX_DEPTH} levels of objects and lists)")


def load_text(text: str) -> Any:
    """JSON, else YAML: what the submit form and the CLI accept."""
    try:
        return load_json(text)
    except DocError:
        raise
    except ValueError:
        return load_yaml(text)
