"""`python manage.py plan < request.json`: the planner's JSON document on stdout (DESIGN.md
"Planner I/O"); logs on stderr; bad input is one line on stderr and exit code 2."""
import json
import sys
import time

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from jobs.planning.constants import constants_for, default_constants
from trainyard.plan import PlanInputError, parse_plan_request, plan


class Command(BaseCommand):
    help = ("Read a plan request (JSON: model, cluster, global_batch, precision?, fix?) on stdin and print "
            "every feasible parallel plan, best first, and the rejected ones with their reason, as one JSON "
            "document. Bad input: one line on stderr, exit code 2.")

    def add_arguments(self, parser):
        parser.add_argument("--limit-rejected", type=int, default=200,
                            help="list at most this many rejected plans, nearest misses first (default 200)")

    def handle(self, *args, limit_rejected, **opts):
        if limit_rejected < 0:
            raise CommandError("--limit-rejected must be >= 0", returncode=2)
        raw = sys.stdin.read()
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise CommandError(f"stdin is not JSON: {exc}", returncode=2) from None
        try:
            req = parse_plan_request(data)
        except PlanInputError as exc:
            raise CommandError(f"bad plan request: {exc}", returncode=2) from None
        try:
            constants = constants_for(req.cluster.device.name)
        except DatabaseError as exc:  # a fresh clone before `migrate`: no calibrations to read
            constants = default_constants(req.cluster.device.name)
            self.stderr.write(f"no calibrations to read ({str(exc).splitlines()[0]}: run `python manage.py "
                              f"migrate` first to use this cluster's): planning with the default constants")
        t0 = time.perf_counter()
        out = plan(req, constants, limit_rejected=limit_rejected)
        self.stderr.write(f"planned {req.cluster.devices} devices with {constants.source} constants in "
                          f"{(time.perf_counter() - t0) * 1000:.1f} ms: {len(out['plans'])} plans, "
                          f"{len(out['rejected'])} rejected listed")
        self.stdout.write(json.dumps(out))
