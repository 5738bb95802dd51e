import os
import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from trainyard.private import private_dir, tighten, write_private


class Command(BaseCommand):
    help = ("Create the superuser 'admin' if missing. Password from TRAINYARD_ADMIN_PASSWORD, else "
            "generated and printed once. With the variable set, an existing admin's password is reset to it.")

    def add_arguments(self, parser):
        parser.add_argument("--username", default="admin")

    def handle(self, *args, username, **opts):
        User = get_user_model()
        wanted = os.environ.get("TRAINYARD_ADMIN_PASSWORD")
        user = User.objects.filter(username=username).first()
        saved = settings.VAR_DIR / "admin_password"
        tighten(saved)  # an older version wrote it under the umask (0644)
        if user is None:
            password = wanted or secrets.token_urlsafe(12)
            User.objects.create_superuser(username, f"{username}@localhost", password)
            if not wanted:
                # Kept (0600 in the 0700 var/) so `make run` can show the login again on the next start.
                private_dir(saved.parent)
                write_private(saved, password)
            shown = password if not wanted else "(from TRAINYARD_ADMIN_PASSWORD)"
            self.stdout.write(f"created superuser {username!r}, password: {shown}")
        elif wanted and not user.check_password(wanted):
            user.set_password(wanted)
            user.save(update_fields=["password"])
            self.stdout.write(f"superuser {username!r}: password set from TRAINYARD_ADMIN_PASSWORD")
        elif not wanted and saved.exists() and user.check_password(saved.read_text().strip()):
            self.stdout.write(f"superuser {username!r}, password: {saved.read_text().strip()}")
        else:
            self.stdout.write(f"superuser {username!r} exists (password unchanged; set TRAINYARD_ADMIN_PASSWORD "
                              "to reset it)")
