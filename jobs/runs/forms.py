"""The submit form: the JobSpec text is what gets posted; the common options are also shown as
fields (kept in sync with the text by static/js/submit.js) so errors can sit next to them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

from django import forms
from pydantic import BaseModel

from trainyard.spec import DataSpec, JobSpec, ModelSpec, ResourcesSpec, SpecError, TrainSpec, parse_text
from trainyard.spec_parallel import CommSpec, ParallelSpec

DEMO_SPEC = """{
  "name": "gpt-demo",
  "model": {"kind": "gpt", "layers": 4, "hidden": 128, "heads": 4, "seq_len": 128, "vocab": 256},
  "data": {"kind": "demo"},
  "train": {"steps": 200, "global_batch": 32, "lr": 0.001},
  "resources": {"nodes": 2, "procs_per_node": 1, "device": "cpu"}
}"""


@dataclass(frozen=True)
class SpecField:
    path: str          # dotted JobSpec path, as in SpecError.errors
    label: str
    kind: str          # text | int | float | select | bool (a select of false/true, sent as a JSON boolean)
    group: str
    choices: tuple[str, ...] = ()
    help: str = ""


def _choices(model: type[BaseModel], name: str) -> tuple[str, ...]:
    """The values of a Literal field of the JobSpec, in the order the spec declares them."""
    return get_args(model.model_fields[name].annotation)


SPEC_FIELDS: tuple[SpecField, ...] = (
    SpecField("name", "Name", "text", "Job"),
    SpecField("priority", "Priority", "select", "Job", _choices(JobSpec, "priority")),
    SpecField("model.kind", "Model", "select", "Model", _choices(ModelSpec, "kind")),
    SpecField("model.layers", "Layers", "int", "Model"),
    SpecField("model.hidden", "Hidden size", "int", "Model"),
    SpecField("model.heads", "Heads", "int", "Model", help="gpt: must divide the hidden size"),
    SpecField("model.seq_len", "Sequence length", "int", "Model"),
    SpecField("data.kind", "Data", "select", "Data", _choices(DataSpec, "kind"),
              help="demo: the shipped text corpus; synthetic: random tokens; tokens: a uint16 .bin file"),
    SpecField("data.path", "Token file", "text", "Data", help="only for data kind 'tokens', under the data root"),
    SpecField("train.steps", "Steps", "int", "Training"),
    SpecField("train.global_batch", "Global batch", "int", "Training", help="divisible by dp"),
    SpecField("train.lr", "Learning rate", "float", "Training"),
    SpecField("resources.nodes", "Nodes", "int", "Resources"),
    SpecField("resources.procs_per_node", "Processes per node", "int", "Resources"),
    SpecField("resources.device", "Device", "select", "Resources", _choices(ResourcesSpec, "device")),
    SpecField("parallel.tp", "Tensor parallel", "int", "Parallelism",
              help="ranks splitting each layer's heads and MLP columns; must divide heads"),
    SpecField("parallel.pp", "Pipeline stages", "int", "Parallelism", help="at most the number of layers"),
    SpecField("parallel.recompute", "Activation recompute", "select", "Parallelism",
              _choices(ParallelSpec, "recompute"),
              help="full: recompute each block's activations in the backward pass (less memory, more compute)"),
    SpecField("parallel.shard_optimizer", "Shard optimizer state", "bool", "Parallelism", ("false", "true"),
              help="ZeRO-1: each data-parallel rank keeps 1/dp of the AdamW state; not with FSDP"),
    SpecField("train.grad_accum", "Gradient accumulation", "int", "Parallelism",
              help="micro-steps per optimizer step, synchronised only on the last"),
    SpecField("comm.compression", "Gradient compression", "select", "Parallelism",
              _choices(CommSpec, "compression"), help="plain data parallelism only"),
    SpecField("comm.sync", "Synchronization", "select", "Parallelism", _choices(CommSpec, "sync")),
    SpecField("train.balance", "Batch balancing", "select", "Parallelism", _choices(TrainSpec, "balance"),
              help="auto: split the batch by each rank's measured speed"),
)
# Errors at a section's own path ("model": "hidden must be divisible by heads") show atop its fields.
GROUP_PATHS = {"Model": "model", "Data": "data", "Training": "train", "Resources": "resources",
               "Parallelism": "parallel"}
FIELD_PATHS = frozenset(f.path for f in SPEC_FIELDS) | frozenset(GROUP_PATHS.values())


def spec_defaults() -> dict:
    return JobSpec(name="x").to_json()


def _lookup(data: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _text(value: Any) -> Any:
    # a boolean as the spec writes it (JSON/YAML), which is what a "bool" field's options say
    return ("true" if value else "false") if isinstance(value, bool) else value


def field_groups(spec: Any, errors: dict[str, list[str]] | None) -> list[dict]:
    """Fields grouped for the template, each with its value in `spec` (a parsed dict, or anything
    when the text did not parse), its default as placeholder, and the errors at its path."""
    defaults = spec_defaults()
    errors = errors or {}
    groups: dict[str, list[dict]] = {}
    for f in SPEC_FIELDS:
        value = _lookup(spec, f.path) if isinstance(spec, dict) else None
        default = _lookup(defaults, f.path) if f.path != "name" else "my-job"
        groups.setdefault(f.group, []).append({
            "path": f.path, "id": "f-" + f.path.replace(".", "-"), "label": f.label, "kind": f.kind,
            "choices": f.choices, "help": f.help, "errors": errors.get(f.path, []),
            "value": "" if value is None or isinstance(value, (dict, list)) else _text(value),
            "placeholder": "" if default is None else _text(default),
        })
    return [{"name": name, "fields": fields, "path": GROUP_PATHS.get(name, ""),
             "errors": errors.get(GROUP_PATHS.get(name, ""), [])} for name, fields in groups.items()]


def split_errors(errors: dict[str, list[str]] | None) -> tuple[dict[str, list[str]], list[tuple[str, list[str]]]]:
    """(errors shown next to a field, the rest as a list)."""
    inline, rest = {}, []
    for path, msgs in (errors or {}).items():
        if path in FIELD_PATHS:
            inline[path] = list(msgs)
        else:
            rest.append((path, list(msgs)))
    return inline, rest


class JobSubmitForm(forms.Form):
    spec = forms.CharField(widget=forms.Textarea(attrs={"rows": 18, "cols": 90, "spellcheck": "false",
                                                        "autocapitalize": "off", "autocomplete": "off"}),
                           initial=DEMO_SPEC, help_text="JobSpec as JSON or YAML")

    def clean_spec(self):
        try:
            return parse_text(self.cleaned_data["spec"])
        except SpecError as exc:
            raise forms.ValidationError(exc.errors["spec"]) from None
