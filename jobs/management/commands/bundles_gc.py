from django.core.management.base import BaseCommand, CommandError

from jobs import services


class Command(BaseCommand):
    help = ("Delete code bundles no job references and nobody uploaded or submitted for --age-s seconds "
            "(default TRAINYARD_BUNDLE_GC_AGE_S), bundle files without a row and abandoned uploads. "
            "The control beat runs the same every hour.")

    def add_arguments(self, parser):
        parser.add_argument("--age-s", type=float, default=None,
                            help="age in seconds (default: settings.TRAINYARD_BUNDLE_GC_AGE_S)")

    def handle(self, *args, age_s, **opts):
        if age_s is not None and age_s < 0:
            raise CommandError("--age-s must be at least 0")
        result = services.bundles_gc(age_s=age_s)
        for digest in result.deleted:
            self.stdout.write(f"deleted {digest}")
        self.stdout.write(f"{len(result.deleted)} bundle(s), {result.orphan_files} orphan file(s), "
                          f"{result.stale_uploads} stale upload(s) deleted; {result.freed_bytes} bytes freed")
