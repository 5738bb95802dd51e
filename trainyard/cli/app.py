"""The `trainyard` commands (click). Every expected failure is one line on stderr and exit code 2;
`watch` (and `submit --watch`) exit 0 when the job SUCCEEDED and 1 when it ended otherwise."""
from __future__ import annotations

import json
import os
import sys

import click

from . import common, config
from .client import Api
from .errors import CliError
from .safe import clean, text

CONTEXT = {"help_option_names": ["-h", "--help"]}


class TrainyardGroup(click.Group):
    """Runs a command and turns every failure into one line: usage errors, CliErrors, aborts,
    and (with TRAINYARD_DEBUG unset) anything unexpected."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:  # bare `trainyard` (or a group): its help
            click.echo(exc.ctx.get_help() if exc.ctx else exc.format_message())
            rv = 0
        except click.UsageError as exc:
            where = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx else ""
            rv = _fail(f"{exc.format_message()}{where}", 2)
        except click.ClickException as exc:
            rv = _fail(exc.format_message(), exc.exit_code)
        except click.Abort:
            rv = _fail("aborted", 2)
        except Exception as exc:  # a bug: still one line, unless asked for the traceback
            if os.environ.get("TRAINYARD_DEBUG"):
                raise
            rv = _fail(f"internal error: {type(exc).__name__}: {exc} (TRAINYARD_DEBUG=1 shows the traceback)", 2)
        code = rv if isinstance(rv, int) else 0
        if not standalone_mode:
            return code
        sys.exit(code)


def _fail(message: str, code: int) -> int:
    # the message may echo server text (an API error naming a job's output): control characters shown
    click.echo(f"error: {clean(' '.join(message.split()))}", err=True)
    return code


_api, _console, _print_json = common.api, common.console, common.print_json


@click.group(cls=TrainyardGroup, context_settings=CONTEXT)
def cli():
    """Submit and follow Trainyard jobs.

    Log in once with `trainyard login URL`; TRAINYARD_URL and TRAINYARD_TOKEN override the
    saved login. Errors are one line on stderr with exit code 2.
    """


@cli.command(context_settings=CONTEXT)
@click.argument("url")
@click.option("--token", help="an API token (`manage.py api_token USER` prints one) instead of a password")
@click.option("-u", "--username", help="the username (asked for when not given)")
def login(url, token, username):
    """Log in to the Trainyard at URL and save the login (0600) in
    $XDG_CONFIG_HOME/trainyard/config.toml (default ~/.config/trainyard/config.toml)."""
    url = config.normalize_url(url)
    if token:
        Api(url, token).get("/api/v1/nodes/", doing="login")  # proves the token before it is saved
        who = "with the given token"
    else:
        username = username or click.prompt("Username")
        # Hidden on a terminal; from a pipe the prompt reads a plain line (nothing is echoed either way).
        password = click.prompt("Password", hide_input=sys.stdin.isatty())
        body = Api(url).request("POST", "/api/v1/auth/token/", body={"username": username, "password": password},
                                doing="login")
        token, who = body["token"], f"as {clean(body['username'])}" + (" (staff)" if body.get("is_staff") else "")
    path = config.save(url, token)
    click.echo(f"logged in to {url} {who}; saved in {path}")
    for name in ("TRAINYARD_URL", "TRAINYARD_TOKEN"):
        if os.environ.get(name):
            click.echo(f"note: {name} is set and overrides the saved value", err=True)


_load_doc = common.load_doc


def _load_spec(path: str) -> dict:
    spec = _load_doc(path, path)
    if not isinstance(spec, dict):
        raise CliError(f"{path}: a JobSpec is a YAML mapping (name: ..., model: ... or entrypoint: ...)")
    try:
        json.dumps(spec, allow_nan=False)
    except (TypeError, ValueError) as exc:  # a YAML date, a set, .nan: not JSON
        raise CliError(f"{path}: every value must be plain JSON data ({exc}); quote it as a string") from None
    return spec


def _upload(api: Api, directory: str) -> str:
    from .pack import pack

    packed = pack(directory)
    res = api.upload("/api/v1/code/", "file", "code.tar.gz", packed.data, doing=f"upload of {directory}")
    if not isinstance(res, dict) or not isinstance(res.get("bundle"), str):
        raise CliError(f"upload of {directory}: the server's answer names no bundle")
    click.echo(f"uploaded {directory}: {len(packed.files)} files, {packed.unpacked_bytes} bytes "
               f"({len(packed.data)} packed) -> {clean(res['bundle'])}", err=True)
    return res["bundle"]


@cli.command(context_settings=CONTEXT)
@click.argument("spec_file", metavar="SPEC.yaml", type=click.Path(dir_okay=False))
@click.option("--code", "code_dir", type=click.Path(file_okay=False),
              help="pack this directory (honouring .gitignore and .trainyardignore), upload it and run the job from it")
@click.option("--pool", help="run on this pool (a Slurm cluster staff configured): sets resources.pool")
@click.option("--watch", "watch_job", is_flag=True, help="then follow the job live; exit 0 iff it SUCCEEDED")
@click.option("--json", "as_json", is_flag=True, help="print the job as JSON instead of its id")
def submit(spec_file, code_dir, pool, watch_job, as_json):
    """Submit the JobSpec in SPEC.yaml (YAML or JSON) and print the new job's id."""
    spec = _load_spec(spec_file)
    if pool:
        if not isinstance(spec.get("resources", {}), dict):
            raise click.UsageError(f"{spec_file}: resources must be a mapping to set --pool")
        spec["resources"] = {**spec.get("resources", {}), "pool": pool}
    api = _api()
    if code_dir:
        spec["code"] = {"bundle": _upload(api, code_dir)}
    job = api.post("/api/v1/jobs/", spec, doing="job refused")
    if as_json:
        _print_json(job)
    else:
        click.echo(clean(job["id"]))
    if watch_job:
        from .watch import watch

        raise click.exceptions.Exit(watch(api, job["id"], _console(stderr=as_json)))


@cli.command("ls", context_settings=CONTEXT)
@click.option("--tag", "tags", multiple=True, help="only jobs carrying this tag (repeat: all of them)")
@click.option("--status", "statuses", multiple=True, help="only jobs in this status, e.g. running (repeat: any)")
@click.option("--owner", help="only this user's jobs")
@click.option("--team", help="only this team's jobs")
@click.option("--node", help="only jobs that ran on this node")
@click.option("--experiment", type=click.IntRange(min=1), help="only the trials of this experiment (its id)")
@click.option("-s", "--search", help="only jobs whose name contains this text")
@click.option("--since", help="submitted on or after (2026-12-06 or 2026-12-06T14:30)")
@click.option("--until", help="submitted on or before (a date: to its end)")
@click.option("--sort", "ordering", help="id, name, status, owner, submitted, started, finished or steps; "
                                         "-name for descending (default: -id, newest first)")
@click.option("--page", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--page-size", type=click.IntRange(1, 500), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print the API's JSON")
def ls(tags, statuses, owner, team, node, experiment, search, since, until, ordering, page, page_size, as_json):
    """List the jobs you can see (yours and your teams'; staff: all), newest first, a page at a time."""
    from .render import jobs_table

    params = {"tag": ",".join(tags) or None, "status": ",".join(s.upper() for s in statuses) or None,
              "owner": owner, "team": team, "node": node, "experiment": experiment, "q": search, "since": since, "until": until,
              "ordering": ordering, "page": page if page > 1 else None,
              "page_size": page_size if page_size != 50 else None}
    result = _api().get("/api/v1/jobs/", params=params, doing="job list")
    if as_json:
        return _print_json(result["results"])
    filtered = any(params[k] for k in ("tag", "status", "owner", "team", "node", "experiment", "q", "since", "until"))
    if not result["results"]:
        return click.echo("no jobs match" if filtered or page > 1 else
                          "no jobs yet: `trainyard submit SPEC.yaml` starts one")
    console = _console()
    console.print(jobs_table(result["results"]))
    if result.get("next") or result.get("previous"):
        pages = -(-result["count"] // page_size)
        console.print(text(f"(page {page} of {pages}, {result['count']} jobs; --page N for another)"))


@cli.command(context_settings=CONTEXT)
@click.argument("job_id", metavar="ID", type=int)
@click.option("--add", "add", multiple=True, metavar="TAG", help="add this tag (repeatable)")
@click.option("--remove", "remove", multiple=True, metavar="TAG", help="remove this tag (repeatable)")
@click.option("--set", "replace", metavar="TAGS", help="replace every tag with these (comma separated; '' clears)")
def tag(job_id, add, remove, replace):
    """Show or change a job's tags (its owner, their team, staff): `tag 7 --add lr-sweep --remove old`."""
    api = _api()
    if replace is not None and (add or remove):
        raise CliError("--set replaces every tag: give it alone, or use --add/--remove")
    if replace is not None:
        job = api.patch(f"/api/v1/jobs/{job_id}/", {"tags": [t for t in replace.replace(" ", ",").split(",") if t]},
                        doing=f"tags of job {job_id}")
    elif add or remove:
        job = api.patch(f"/api/v1/jobs/{job_id}/", {"tags_add": list(add), "tags_remove": list(remove)},
                        doing=f"tags of job {job_id}")
    else:
        job = api.get(f"/api/v1/jobs/{job_id}/", doing=f"job {job_id}")
    click.echo(f"job {job_id}: " + (clean(", ".join(job.get("tags") or [])) or "no tags"))


@cli.command(context_settings=CONTEXT)
@click.argument("job_id", metavar="ID", type=int)
@click.argument("note_text", metavar="TEXT", required=False)
@click.option("--clear", is_flag=True, help="remove the note")
def note(job_id, note_text, clear):
    """Show or set a job's note (its owner, their team, staff): `note 7 "lr too high, diverged at 2k"`."""
    api = _api()
    if clear and note_text is not None:
        raise CliError("give TEXT or --clear, not both")
    if note_text is None and not clear:
        job = api.get(f"/api/v1/jobs/{job_id}/", doing=f"job {job_id}")
        lines = (job.get("note") or "").split("\n")  # a note's own newlines kept, nothing else raw
        return click.echo("\n".join(map(clean, lines)).strip() or f"job {job_id} has no note")
    api.patch(f"/api/v1/jobs/{job_id}/", {"note": "" if clear else note_text}, doing=f"note of job {job_id}")
    click.echo(f"job {job_id}: note {'cleared' if clear else 'saved'}")


@cli.command(context_settings=CONTEXT)
@click.argument("job_id", metavar="ID", type=int)
@click.option("--json", "as_json", is_flag=True, help="print the API's JSON")
def show(job_id, as_json):
    """Show one job: status, progress, attempts."""
    from .render import job_view

    job = _api().get(f"/api/v1/jobs/{job_id}/", doing=f"job {job_id}")
    if as_json:
        return _print_json(job)
    console = _console()
    for part in job_view(job):
        console.print(part)


@cli.command(context_settings=CONTEXT)
@click.argument("job_id", metavar="ID", type=int)
def watch(job_id):
    """Follow a job live (step/steps, loss, samples/s, ETA, status changes).
    Exit code 0 when it SUCCEEDED, 1 when it FAILED or was CANCELLED."""
    from .watch import watch as run_watch

    raise click.exceptions.Exit(run_watch(_api(), job_id, _console()))


@cli.command(context_settings=CONTEXT)
@click.argument("job_id", metavar="ID", type=int)
def cancel(job_id):
    """Cancel a job (its owner or staff)."""
    job = _api().post(f"/api/v1/jobs/{job_id}/cancel/", doing=f"cancel of job {job_id}")
    click.echo(f"job {job_id}: cancel requested, now {clean(job['status'])}")


@cli.command(context_settings=CONTEXT)
@click.argument("job_id", metavar="ID", type=int)
@click.option("--json", "as_json", is_flag=True, help="print the API's JSON")
def checkpoints(job_id, as_json):
    """List a job's checkpoints, newest first (the IDs `rollback` takes)."""
    from .render import checkpoints_table

    page = _api().get(f"/api/v1/jobs/{job_id}/checkpoints/", params={"page_size": 500}, doing=f"job {job_id}")
    if as_json:
        return _print_json(page["results"])
    if not page["results"]:
        return click.echo(f"job {job_id} has no checkpoints")
    _console().print(checkpoints_table(page["results"]))


@cli.command(context_settings=CONTEXT)
@click.argument("job_id", metavar="ID", type=int)
@click.argument("checkpoint", metavar="CHECKPOINT", type=int)
def rollback(job_id, checkpoint):
    """Roll a job back to one of its checkpoints (staff only; see `trainyard checkpoints ID`)."""
    job = _api().post(f"/api/v1/jobs/{job_id}/rollback/", {"checkpoint": checkpoint},
                      doing=f"rollback of job {job_id}")
    click.echo(f"job {job_id}: rolling back to checkpoint {checkpoint}, now {clean(job['status'])}")


@cli.command(context_settings=CONTEXT)
@click.option("--json", "as_json", is_flag=True, help="print the API's JSON")
def nodes(as_json):
    """List the cluster's nodes: status, slots in use, load."""
    from .render import nodes_table

    page = _api().get("/api/v1/nodes/", doing="node list")
    if as_json:
        return _print_json(page["results"])
    _console().print(nodes_table(page["results"]))


@cli.command(context_settings=CONTEXT)
@click.argument("job_id", metavar="ID", type=int)
@click.option("-f", "--follow", is_flag=True, help="keep printing new lines until the job ends")
@click.option("--rank", type=click.IntRange(min=0), help="only this rank's lines")
@click.option("--attempt", type=click.IntRange(min=1), help="only this attempt's lines (its id, as `show` lists)")
def logs(job_id, follow, rank, attempt):
    """Print a job's logs (every rank, or --rank R; every attempt, or --attempt A)."""
    from .logs import print_logs

    print_logs(_api(), job_id, rank=rank, attempt=attempt, follow=follow)


def _load_request(path: str) -> dict:
    """A plan request from FILE or stdin ("-"): JSON (or YAML, its superset)."""

    where = "stdin" if path == "-" else path
    data = _load_doc(path, where, sys.stdin.read() if path == "-" else None)
    if not isinstance(data, dict):
        raise CliError(f"{where}: a plan request is an object {{model, cluster, global_batch, precision?, fix?}}")
    return data


@cli.command(context_settings=CONTEXT)
@click.argument("request_file", metavar="FILE|-")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True, help="plans to show")
@click.option("--json", "as_json", is_flag=True, help="print the planner's JSON document")
def plan(request_file, top, as_json):
    """Plan a model on a cluster: the best parallel layouts (dp, tp, pp, micro-batch, sharding,
    recompute, schedule) with predicted step time, memory and TFLOP/s, and how many were rejected.
    FILE (or - for stdin) holds {model, cluster, global_batch, precision?, fix?} as JSON or YAML."""
    from .render import plans_view

    result = _api().post("/api/v1/plan/", _load_request(request_file), doing="plan")
    if as_json:
        return _print_json(result)
    console = _console()
    for part in plans_view(result, top):
        console.print(text(part) if isinstance(part, str) else part)


def _experiments():
    from .experiment import experiment

    cli.add_command(experiment)


_experiments()
