import json
import platform
import sys

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from jobs.core.errors import InvalidInput
from jobs.planning.services.calibration import calibration_store
from trainyard.calibration import HarnessFailed, run_harness


def _brief(e: dict) -> dict:
    return {k: v for k, v in e.items() if k != "per_run"}


class Command(BaseCommand):
    help = ("Measure this machine (python -m workers.calibrate: matmul, collectives, a grid of short GPT "
            "runs), fit the planner's constants on two thirds of the runs, evaluate them on the others "
            "against the defaults, store a Calibration and print one JSON document with the figures.")

    def add_arguments(self, parser):
        parser.add_argument("--quick", action="store_true", help="the harness's quick sweep (about a minute)")
        parser.add_argument("--node", default=None, help="the node name to record (default: this host)")
        parser.add_argument("--timeout", type=float, default=None, help="seconds the harness may take")
        parser.add_argument("--measurements", default=None,
                            help="fit a document the harness wrote earlier instead of measuring")

    def handle(self, *args, quick, node, timeout, measurements, **opts):
        if timeout is not None and timeout <= 0:
            raise CommandError("--timeout must be positive")
        summary = {}
        if measurements:
            try:
                with open(measurements) as f:
                    doc = json.load(f)
            except (OSError, ValueError) as e:
                raise CommandError(f"--measurements: {e}") from None
        else:
            try:
                doc, summary = run_harness(quick=quick, python=sys.executable, cwd=str(settings.BASE_DIR),
                                           timeout_s=timeout)
            except HarnessFailed as e:
                raise CommandError(str(e)) from None
        try:
            row = calibration_store(doc, node=node or platform.node())
        except InvalidInput as e:
            raise CommandError(f"invalid measurements: {e}") from None
        ev = row.evaluation
        self.stdout.write(json.dumps({
            "id": row.pk, "device": row.device_name, "node": row.node, "runs": len(doc.get("runs", [])),
            "harness": summary, "held_out": ev["held_out"], "peak_tflops": row.peak_tflops,
            "before": _brief(ev["before"]), "after": _brief(ev["after"]), "constants": row.constants}, indent=1))
