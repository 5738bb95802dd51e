"""`trainyard experiment submit|ls|show|stop|best|continue`: hyperparameter searches (issue 25)
over the experiments API. An experiment file is YAML or JSON, either {name?, spec, search} as the
API takes it, or a JobSpec with a top-level `search` block (the JobSpec is the template)."""
from __future__ import annotations

import json

import click
from rich.table import Table

from . import common
from .errors import CliError
from .safe import clean, text
from ..rules import SpecError
from ..search import experiment_document


def experiment_body(doc: object, where: str) -> dict:
    """{name, spec, search} from an experiment file's document, or CliError naming the problem."""
    try:
        return experiment_document(doc)
    except SpecError as exc:
        raise CliError("; ".join(f"{where}: {path}: {' '.join(msgs)}" for path, msgs in exc.errors.items())) from None


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def trials_table(e: dict) -> Table:
    paths = list((e.get("search") or {}).get("space") or {})
    t = Table(box=None, header_style="bold")
    for col in ("#", "JOB", *paths, "STATUS", (e.get("search") or {}).get("metric", "METRIC").upper(), "STEPS", "RUNG"):
        t.add_column(col, no_wrap=True)
    for tr in e.get("trials") or []:
        values = tr.get("values") or {}
        t.add_row(*(text(c) for c in (
            tr.get("number"), tr.get("job") if tr.get("job") is not None else "-",
            *(_fmt(values.get(p)) for p in paths), tr.get("status"),
            _fmt(tr["metric"]) if tr.get("metric") is not None else "-", tr.get("steps", 0),
            tr["rung"] if tr.get("rung") is not None else "-")))
    return t


@click.group("experiment", context_settings={"help_option_names": ["-h", "--help"]})
def experiment():
    """Hyperparameter searches: each trial is a job (the template with the trial's values);
    ASHA stops the worse ones early."""


@experiment.command("submit")
@click.argument("file", metavar="FILE.yaml|json", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print the experiment as JSON instead of its id")
def submit(file, as_json):
    """Submit the experiment in FILE and print its id."""
    body = experiment_body(common.load_doc(file, file), file)
    e = common.api().post("/api/v1/experiments/", body, doing="experiment refused")
    if as_json:
        return common.print_json(e)
    click.echo(clean(e["id"]))
    click.echo(f"experiment {clean(e['id'])}: {len(e.get('trials') or [])} trial(s) queued "
               f"(jobs {', '.join(clean(t['job']) for t in e.get('trials') or [])})", err=True)


@experiment.command("ls")
@click.option("--json", "as_json", is_flag=True, help="print the API's JSON")
def ls(as_json):
    """List the experiments you can see (yours and your teams'), newest first."""
    page = common.api().get("/api/v1/experiments/", doing="experiment list")
    if as_json:
        return common.print_json(page["results"])
    if not page["results"]:
        return click.echo("no experiments yet: `trainyard experiment submit FILE.yaml` starts one")
    t = Table(box=None, header_style="bold")
    for col in ("ID", "NAME", "STATUS", "OWNER", "TRIALS", "CREATED"):
        t.add_column(col, no_wrap=col != "NAME")
    for e in page["results"]:
        counts = ", ".join(f"{n} {s}" for s, n in (e.get("trials") or {}).items())
        t.add_row(*(text(c) for c in (e["id"], e.get("name", ""), e.get("status", ""), e.get("owner", ""),
                                      counts, (e.get("created_at") or "")[:19].replace("T", " "))))
    common.console().print(t)


@experiment.command("show")
@click.argument("experiment_id", metavar="ID", type=int)
@click.option("--json", "as_json", is_flag=True, help="print the API's JSON")
def show(experiment_id, as_json):
    """Show one experiment: status, best trial, every trial."""
    e = common.api().get(f"/api/v1/experiments/{experiment_id}/", doing=f"experiment {experiment_id}")
    if as_json:
        return common.print_json(e)
    console = common.console()
    s = e.get("search") or {}
    console.print(text(f"experiment {e['id']} {e.get('name', '')}: {e.get('status')}"
                       + (f" ({e['status_reason']})" if e.get("status_reason") else "")))
    console.print(text(f"{s.get('algorithm')} search, {s.get('mode')} {s.get('metric')}, "
                       f"{s.get('max_trials')} trials, {s.get('max_concurrent')} at once"))
    b = e.get("best")
    console.print(text("best: " + (f"trial {b['number']} (job {b['job']}) {s.get('metric')} {_fmt(b['metric'])} with "
                                   + ", ".join(f"{k}={_fmt(v)}" for k, v in (b.get("values") or {}).items())
                                   if b else "none yet")))
    console.print(trials_table(e))


@experiment.command("stop")
@click.argument("experiment_id", metavar="ID", type=int)
def stop(experiment_id):
    """Stop an experiment: its running trials are cancelled, no new ones start."""
    e = common.api().post(f"/api/v1/experiments/{experiment_id}/stop/", doing=f"stop of experiment {experiment_id}")
    click.echo(f"experiment {experiment_id}: {clean(e['status'])}")


@experiment.command("best")
@click.argument("experiment_id", metavar="ID", type=int)
def best(experiment_id):
    """Print the best trial's JobSpec (JSON, which is YAML too), ready for `trainyard submit`."""
    e = common.api().get(f"/api/v1/experiments/{experiment_id}/", doing=f"experiment {experiment_id}")
    if not e.get("best_spec"):
        raise CliError(f"experiment {experiment_id} has no best trial yet: no trial reported "
                       f"{(e.get('search') or {}).get('metric', 'its metric')}")
    click.echo(json.dumps(e["best_spec"], indent=2, sort_keys=True))


@experiment.command("continue")
@click.argument("experiment_id", metavar="ID", type=int)
@click.argument("job_id", metavar="JOB", type=int)
def continue_trial(experiment_id, job_id):
    """Continue an early-stopped trial (its job JOB) from its checkpoint."""
    common.api().post(f"/api/v1/experiments/{experiment_id}/trials/{job_id}/continue/",
                       doing=f"continue of job {job_id}")
    click.echo(f"experiment {experiment_id}: job {job_id} queued again, resuming from its checkpoint")
