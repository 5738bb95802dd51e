"""API tokens stored hashed (issue 15, section 3): the ApiToken table, and every key DRF's authtoken
kept in clear text moved into it as its SHA-256, then wiped from authtoken_token, so existing users'
keys keep working and the database no longer holds them. rest_framework.authtoken is no longer
installed, so its table is read with plain SQL when an older database has it."""
import hashlib
from datetime import datetime, timezone

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

OLD_TABLE = "authtoken_token"


def hash_plaintext_tokens(apps, schema_editor):
    connection = schema_editor.connection
    if OLD_TABLE not in connection.introspection.table_names():
        return
    ApiToken = apps.get_model("jobs", "ApiToken")
    User = apps.get_model(*settings.AUTH_USER_MODEL.split("."))
    table = connection.ops.quote_name(OLD_TABLE)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {connection.ops.quote_name('key')}, user_id, created FROM {table}")
        rows = cursor.fetchall()
    existing = set(User.objects.filter(pk__in=[r[1] for r in rows]).values_list("pk", flat=True))
    for key, user_id, created in rows:
        if user_id in existing:
            token = ApiToken.objects.create(user_id=user_id, digest=hashlib.sha256(key.encode()).hexdigest(),
                                            prefix=key[:8])
            if isinstance(created, datetime) and settings.USE_TZ and created.tzinfo is None:
                created = created.replace(tzinfo=timezone.utc)  # SQLite hands back the stored UTC naive
            if isinstance(created, datetime):
                ApiToken.objects.filter(pk=token.pk).update(created=created)
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {table}")


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0009_merge_calibration"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="ApiToken",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("digest", models.CharField(help_text="SHA-256 of the key, hex", max_length=64, unique=True)),
                ("prefix", models.CharField(help_text="the key's first characters, to tell tokens apart",
                                            max_length=8)),
                ("created", models.DateTimeField(auto_now_add=True)),
                ("user", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="api_tokens",
                                           to=settings.AUTH_USER_MODEL)),
            ],
            options={"ordering": ["-id"]},
        ),
        migrations.RunPython(hash_plaintext_tokens, migrations.RunPython.noop),
    ]
