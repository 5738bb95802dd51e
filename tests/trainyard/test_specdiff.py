"""trainyard/specdiff.py: the compare page's spec diff, table-tested (pure)."""
from __future__ import annotations

import pytest

from trainyard.specdiff import ABSENT, SpecField, flatten, show, spec_diff


@pytest.mark.parametrize("spec, flat", [
    ({}, {}),
    ({"name": "a"}, {"name": "a"}),
    ({"train": {"lr": 1e-3, "steps": 10}}, {"train.lr": 1e-3, "train.steps": 10}),
    ({"config": {}}, {"config": {}}),                                   # an empty mapping is a leaf
    ({"entrypoint": {"args": ["--lr", "3"]}}, {"entrypoint.args": ["--lr", "3"]}),   # lists are leaves
    ({"comm": {"periods": {"node": 2, "global": 8}}}, {"comm.periods.node": 2, "comm.periods.global": 8}),
])
def test_flatten(spec, flat):
    assert flatten(spec) == flat


@pytest.mark.parametrize("specs, rows", [
    ([], []),
    ([{"name": "a"}], [SpecField("name", ("a",), False)]),
    ([{"name": "a", "train": {"lr": 1e-3}}, {"name": "b", "train": {"lr": 1e-3}}],
     [SpecField("name", ("a", "b"), True), SpecField("train.lr", (1e-3, 1e-3), False)]),
    ([{"x": 1}, {"x": 1.0}], [SpecField("x", (1, 1.0), False)]),         # the same number
    ([{"x": True}, {"x": 1}], [SpecField("x", (True, 1), True)]),         # a bool is not a number
    ([{"x": None}, {}], [SpecField("x", (None, ABSENT), True)]),           # null is not absent
    ([{"model": {"kind": "gpt"}}, {"entrypoint": {"script": "t.py"}}, {"model": {"kind": "gpt"}}],
     [SpecField("entrypoint.script", (ABSENT, "t.py", ABSENT), True),
      SpecField("model.kind", ("gpt", ABSENT, "gpt"), True)]),
    ([{"a": ["x", "y"]}, {"a": ["x", "y"]}, {"a": ["y", "x"]}], [SpecField("a", (["x", "y"], ["x", "y"], ["y", "x"]), True)]),
    ([{"c": {"k": {"b": 1, "a": 2}}}, {"c": {"k": {"a": 2, "b": 1}}}],
     [SpecField("c.k.a", (2, 2), False), SpecField("c.k.b", (1, 1), False)]),
])
def test_spec_diff(specs, rows):
    assert spec_diff(specs) == rows


@pytest.mark.parametrize("value, text", [
    ("gpt", "gpt"), (1e-3, "0.001"), (None, "null"), (True, "true"), (["a", 1], '["a", 1]'), ({}, "{}"), (ABSENT, "–"),
])
def test_show(value, text):
    assert show(value) == text
