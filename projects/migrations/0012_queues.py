from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("projects", "0011_run_control")]

    operations: list[migrations.operations.base.Operation] = [
        migrations.AddField(
            model_name="basemodel",
            name="queue",
            field=models.CharField(
                blank=True,
                default="",
                help_text="Celery queue its runs, evaluations and training jobs go to (a GPU class, e.g. "
                "gpu-large); empty: settings.WORK_QUEUE_DEFAULT (projects.queues)",
                max_length=63,
            ),
        ),
    ]
