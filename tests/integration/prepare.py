"""A test cluster's database in one process (tests/integration/cluster.py): migrate, the admin,
the nodes registered by staff, then the admin's API token on stdout. The same management commands
make run and an operator run, through call_command: one Django start instead of five (each is
about a second of a 2-core machine, and every integration and browser module starts a cluster).

    python -m tests.integration.prepare NAME=ADDRESS=CREDENTIAL_FILE ... --slots N
"""
from __future__ import annotations

import argparse
import io
import os
from contextlib import redirect_stdout

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("nodes", nargs="*", metavar="NAME=ADDRESS=CREDENTIAL_FILE")
    parser.add_argument("--slots", type=int, required=True)
    parser.add_argument("--labels", default="rack=r1")
    args = parser.parse_args()

    import django
    django.setup()
    from django.core.management import call_command

    with redirect_stdout(io.StringIO()):
        call_command("migrate", interactive=False, verbosity=0)
        call_command("ensure_admin")
        for node in args.nodes:
            name, address, credential = node.split("=", 2)
            call_command("node_add", name, "--address", address, "--slots", str(args.slots),
                         "--labels", args.labels, "--credential-out", credential)
    call_command("api_token", "admin")


if __name__ == "__main__":
    main()
