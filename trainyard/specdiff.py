"""Which JobSpec fields differ between jobs, by dotted path (the compare page, issue 25 section 2).

Pure: mappings in, frozen rows out. A spec is flattened to {dotted path: leaf}: nested mappings are
walked (an empty one is a leaf `{}`), lists are leaves compared whole (entrypoint.args, a choice list).
A path one spec lacks (a user-code job has no `model`) holds ABSENT for it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()


@dataclass(frozen=True)
class SpecField:
    path: str
    values: tuple  # one per spec, in the order given; ABSENT where a spec has no such path
    differs: bool


def flatten(spec: Mapping, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in spec.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


def _same(a: Any, b: Any) -> bool:
    if a is ABSENT or b is ABSENT:
        return a is b
    # 1 and 1.0 are the same value; True and 1 are not (json.dumps tells them apart)
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True) or (
        isinstance(a, (int, float)) and isinstance(b, (int, float))
        and not isinstance(a, bool) and not isinstance(b, bool) and a == b)


def spec_diff(specs: Sequence[Mapping]) -> list[SpecField]:
    """Every path of any spec, sorted, with each spec's value and whether they differ."""
    flat = [flatten(s) for s in specs]
    paths = sorted(set().union(*flat)) if flat else []
    rows = []
    for path in paths:
        values = tuple(f.get(path, ABSENT) for f in flat)
        rows.append(SpecField(path, values, any(not _same(values[0], v) for v in values[1:])))
    return rows


def show(value: Any) -> str:
    """A value as the table prints it: strings bare, everything else as JSON, ABSENT as a dash."""
    if value is ABSENT:
        return "–"
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True)
