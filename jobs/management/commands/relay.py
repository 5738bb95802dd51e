from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from jobs.telemetry.keptlogs import default_keeper
from jobs.telemetry.relay import Relay
from jobs.telemetry.relay_workers import Workers, parse_shard, shard_argv


class Command(BaseCommand):
    help = "Run the telemetry relay: job Redis Streams -> database (and, later, websockets)."

    def add_arguments(self, parser):
        parser.add_argument("--consumer", default="relay-1",
                            help="stable consumer name: a restarted relay re-reads its own unacked entries")
        parser.add_argument("--batch", type=int, default=500)
        parser.add_argument("--workers", type=int, default=None,
                            help="relay processes, one per core, each reading its share of the streams "
                                 "(default TRAINYARD_RELAY_WORKERS, 1)")
        parser.add_argument("--shard", default=None, help="i/N: be relay process i of N (what --workers starts)")

    def handle(self, *args, **opts):
        workers = opts["workers"] if opts["workers"] is not None else settings.TRAINYARD_RELAY_WORKERS
        if opts["shard"] is None and workers > 1:
            raise SystemExit(Workers([shard_argv(i, workers, opts["consumer"], opts["batch"])
                                      for i in range(workers)]).run())
        try:
            shard = parse_shard(opts["shard"]) if opts["shard"] else (0, 1)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        # the kept logs go under TRAINYARD_KEPT_LOG_ROOT (the control plane's own directory)
        Relay(consumer=opts["consumer"], batch=opts["batch"], keeper=default_keeper(), shard=shard).run_forever()
