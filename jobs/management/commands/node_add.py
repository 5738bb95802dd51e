from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from jobs import services
from jobs.core.errors import InvalidInput
from trainyard.private import private_dir, write_private


def parse_labels(items: list[str]) -> dict[str, str] | None:
    """`k=v` items (each may hold several, comma-separated) -> a dict; None when none were given."""
    if not items:
        return None
    out: dict[str, str] = {}
    for part in (p for item in items for p in item.split(",") if p):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise CommandError(f"--labels: expected key=value, got {part!r}")
        out[key.strip()] = value.strip()
    return out


class Command(BaseCommand):
    help = ("Register (approve) node NAME and issue its credential, shown once: printed alone on stdout, or "
            "written 0600 to --credential-out. The agent starts with --credential-file holding it; the database "
            "keeps only its salt and SHA-256. --reissue replaces an existing node's credential (the old one "
            "stops working) and its registered slots, address and labels.")

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--slots", type=int, default=1, help="the most slots its heartbeats may offer (default 1)")
        parser.add_argument("--address", default="", help="its rendezvous address (default: its first heartbeat's)")
        parser.add_argument("--labels", nargs="*", default=[], help="k=v ... (or k=v,k2=v2)")
        parser.add_argument("--reissue", action="store_true", help="replace the credential of a registered node")
        parser.add_argument("--credential-out", default="", help="write the credential to this file (0600)")

    def handle(self, *args, name, slots, address, labels, reissue, credential_out, **opts):
        try:
            node, credential = services.node_add(name, slots=slots, address=address, labels=parse_labels(labels),
                                                 reissue=reissue)
        except InvalidInput as exc:
            raise CommandError("; ".join(f"{k}: {' '.join(v)}" for k, v in exc.errors.items())) from None
        if credential_out:
            path = Path(credential_out)
            private_dir(path.parent)
            write_private(path, credential + "\n")
            self.stderr.write(f"node {node.name} registered; its credential is in {path} (0600): start its agent "
                              f"with --credential-file {path}")
        else:
            self.stdout.write(credential)
            self.stderr.write(f"node {node.name} registered: save the credential above in a 0600 file on the node "
                              "and start its agent with --credential-file FILE (it is not shown again)")
