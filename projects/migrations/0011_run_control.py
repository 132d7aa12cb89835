import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("projects", "0010_retention_exports")]

    operations: list[migrations.operations.base.Operation] = [
        migrations.AddField(
            model_name="run",
            name="pause_requested",
            field=models.BooleanField(
                default=False, help_text="the worker pauses the run before its next step (services.run_pause)"
            ),
        ),
        migrations.AddField(
            model_name="run",
            name="forked_from",
            field=models.ForeignKey(
                blank=True,
                help_text="the checkpoint this run's model was forked from (its step 0 is a copy of it)",
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="forks",
                to="projects.checkpoint",
            ),
        ),
    ]
