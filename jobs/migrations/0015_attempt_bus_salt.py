"""Issue 21: each attempt's salt for its bus password, manifest-proof key and rendezvous token
(trainyard/attemptauth.py). AddField evaluates the default once for the rows already there, so
each existing attempt then gets a salt of its own."""

import trainyard.attemptauth
from django.db import migrations, models


def own_salts(apps, schema_editor):
    Attempt = apps.get_model("jobs", "Attempt")
    for pk in Attempt.objects.values_list("pk", flat=True).iterator():
        Attempt.objects.filter(pk=pk).update(bus_salt=trainyard.attemptauth.new_salt())


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0014_control_clock_and_fences'),
    ]

    operations = [
        migrations.AddField(
            model_name='attempt',
            name='bus_salt',
            field=models.CharField(default=trainyard.attemptauth.new_salt, editable=False, max_length=64),
        ),
        migrations.RunPython(own_salts, migrations.RunPython.noop),
    ]
