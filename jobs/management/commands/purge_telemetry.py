import json

from django.core.management.base import BaseCommand, CommandError

from jobs import services


class Command(BaseCommand):
    help = ("Apply telemetry retention now (the control beat does it every TRAINYARD_TELEMETRY_PURGE_S): thin "
            "per-rank samples beyond each job's recent window, and delete what ended longer ago than the "
            "retention settings keep (per-rank samples, per-step rows, kept logs, finished jobs). "
            "--dry-run counts what would go and deletes nothing.")

    def add_arguments(self, parser):
        parser.add_argument("--dry-run", action="store_true", help="count what would be removed; remove nothing")
        parser.add_argument("--budget-s", type=float, default=None,
                            help="stop after about this many seconds (default: no limit)")
        parser.add_argument("--json", action="store_true", help="print the result as one JSON object")

    def handle(self, *args, dry_run, budget_s, json: bool = False, **opts):
        if budget_s is not None and budget_s <= 0:
            raise CommandError("--budget-s must be positive")
        r = services.telemetry_purge(dry_run=dry_run, budget_s=budget_s if budget_s is not None else float("inf"))
        if json:
            self.stdout.write(_json(r.as_dict()))
            return
        verb = "would remove" if dry_run else "removed"
        self.stdout.write(f"{verb} {r.rank_rows_thinned} per-rank sample(s) beyond the recent window "
                          f"({len(r.jobs_thinned)} job(s))")
        self.stdout.write(f"{verb} {r.rank_rows_expired} per-rank sample(s) and {r.step_rows_expired} per-step "
                          "row(s) of jobs that ended long enough ago")
        self.stdout.write(f"{verb} the kept logs of {len(r.logs_removed)} job(s) ({r.log_bytes_removed} bytes)"
                          + (f": {', '.join(map(str, r.logs_removed))}" if r.logs_removed else ""))
        self.stdout.write(f"{verb} {len(r.jobs_deleted)} finished job(s)"
                          + (f": {', '.join(map(str, r.jobs_deleted))}" if r.jobs_deleted else ""))
        self.stdout.write(f"{r.batches} batch(es), longest {r.max_batch_s * 1000:.1f} ms, {r.seconds:.2f} s"
                          + ("" if r.complete else "; stopped at the time budget, run again to go on"))


def _json(d: dict) -> str:
    return json.dumps(d, sort_keys=True)
