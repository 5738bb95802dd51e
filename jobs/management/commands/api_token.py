from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from jobs.access import services as access_services


class Command(BaseCommand):
    help = ("Create a new API token for USERNAME and print its key alone on stdout: the only time it is "
            "shown (the database keeps its SHA-256). --revoke deletes all of USERNAME's tokens instead "
            "(their open websockets close).")

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--revoke", action="store_true", help="delete every token of USERNAME")

    def handle(self, *args, username, revoke=False, **opts):
        try:
            user = get_user_model().objects.get(username=username)
        except get_user_model().DoesNotExist:
            raise CommandError(f"no user named {username!r}") from None
        if revoke:
            count, _ = user.api_tokens.all().delete()
            self.stderr.write(f"revoked {count} token(s) of {username!r}")
            return
        if not user.is_active:
            raise CommandError(f"user {username!r} is inactive: a token would not authenticate")
        self.stdout.write(access_services.token_issue(user))
