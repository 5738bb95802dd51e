from django import forms

from .specs import SpecError, parse_text

DEMO_SPEC = """{
  "name": "gpt-demo",
  "model": {"kind": "gpt", "layers": 4, "hidden": 128, "heads": 4, "seq_len": 128, "vocab": 256},
  "data": {"kind": "demo"},
  "train": {"steps": 200, "global_batch": 32, "lr": 0.001},
  "resources": {"nodes": 2, "procs_per_node": 1, "device": "cpu"}
}"""


class JobSubmitForm(forms.Form):
    spec = forms.CharField(widget=forms.Textarea(attrs={"rows": 18, "cols": 90, "spellcheck": "false"}),
                           initial=DEMO_SPEC, help_text="JobSpec as JSON or YAML")

    def clean_spec(self):
        try:
            return parse_text(self.cleaned_data["spec"])
        except SpecError as exc:
            raise forms.ValidationError(exc.errors["spec"]) from None
