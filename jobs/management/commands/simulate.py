import json

from django.core.management.base import BaseCommand, CommandError

from jobs.scheduling.policy import POLICIES
from jobs.scheduling.simulation import SimConfig, TraceError, read_quotas, read_trace, simulate


class Command(BaseCommand):
    help = ("Replay a job trace (CSV: job_id,submit_s,user,team,slots,duration_s,estimate_s,priority) through "
            "the scheduler under simulated time and report JCT, waits, utilization and each team's share of "
            "its entitlement. With --json, one JSON document on stdout; progress goes to stderr.")

    def add_arguments(self, parser):
        parser.add_argument("--trace", required=True, help="CSV trace file (bench/tracegen.py writes one)")
        parser.add_argument("--policy", default="trainyard", help=f"one of {', '.join(POLICIES)} (default trainyard)")
        parser.add_argument("--nodes", type=int, default=32)
        parser.add_argument("--slots-per-node", type=int, default=8)
        parser.add_argument("--quotas", help='JSON file {"team": slots, ...}; default: equal shares of the cluster')
        parser.add_argument("--checkpoint-every-s", type=float, default=600.0,
                            help="simulated checkpoint cadence: a preempted job loses the work since the last one")
        parser.add_argument("--fixed", action="store_true",
                            help="run the trace's elastic jobs (column min_slots) at their most nodes, as fixed-size jobs")
        parser.add_argument("--json", action="store_true", dest="as_json", help="print one JSON document")

    def handle(self, *args, trace, policy, nodes, slots_per_node, quotas, checkpoint_every_s, as_json, fixed=False, **opts):
        if policy not in POLICIES:
            raise CommandError(f"unknown policy {policy!r}: use one of {', '.join(POLICIES)}")
        if nodes < 1 or slots_per_node < 1:
            raise CommandError("--nodes and --slots-per-node must be at least 1")
        if checkpoint_every_s <= 0:
            raise CommandError("--checkpoint-every-s must be > 0")
        try:
            with open(trace, newline="") as f:
                jobs = read_trace(f, name=trace)
            entitlements = None
            if quotas:
                with open(quotas) as f:
                    try:
                        entitlements = read_quotas(json.load(f), name=quotas)
                    except ValueError as e:
                        if isinstance(e, TraceError):
                            raise
                        raise TraceError(f"{quotas} is not valid JSON: {e}") from None
        except OSError as e:
            raise CommandError(f"cannot read {e.filename}: {e.strerror}") from None
        except (TraceError, UnicodeDecodeError) as e:
            raise CommandError(str(e)) from None
        log = self.stderr.write
        log(f"simulating {len(jobs)} jobs on {nodes} x {slots_per_node} slots under {policy}")
        try:
            result = simulate(jobs, SimConfig(policy=policy, nodes=nodes, slots_per_node=slots_per_node,
                                              quotas=entitlements, checkpoint_every_s=checkpoint_every_s,
                                              elastic=not fixed), log=log)
        except TraceError as e:
            raise CommandError(str(e)) from None
        if as_json:
            self.stdout.write(json.dumps(result))
            return
        out = self.stdout.write
        out(f"policy {result['policy']}: {result['jobs']} jobs on {nodes} x {slots_per_node} slots")
        for key in ("avg_jct_s", "p50_jct_s", "p99_jct_s", "avg_wait_s", "makespan_s", "utilization",
                    "preemptions", "lost_slot_s", "resizes", "elastic_jobs"):
            out(f"  {key:<14} {result[key]}")
        for team, row in result["teams"].items():
            share = row["share_of_entitlement"]
            out(f"  team {team}: entitled to {row['entitlement_slots']} slots, used {row['used_slot_s']:.0f} "
                f"slot-s, share of entitlement {'-' if share is None else f'{share:.3f}'}")
        if result["skipped_jobs"]:
            out(f"  skipped (larger than the cluster): {', '.join(map(str, result['skipped_jobs']))}")

