from django.core.management.base import BaseCommand

from jobs.telemetry.keptlogs import default_keeper
from jobs.telemetry.relay import Relay


class Command(BaseCommand):
    help = "Run the telemetry relay: job Redis Streams -> database (and, later, websockets)."

    def add_arguments(self, parser):
        parser.add_argument("--consumer", default="relay-1",
                            help="stable consumer name: a restarted relay re-reads its own unacked entries")
        parser.add_argument("--batch", type=int, default=500)

    def handle(self, *args, **opts):
        # the kept logs go under TRAINYARD_KEPT_LOG_ROOT (the control plane's own directory)
        Relay(consumer=opts["consumer"], batch=opts["batch"], keeper=default_keeper()).run_forever()
