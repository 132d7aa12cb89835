from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("projects", "0008_training_jobs")]

    operations: list[migrations.operations.base.Operation] = [
        migrations.AddField(
            model_name="checkpoint",
            name="storage_key",
            field=models.CharField(blank=True, default="", max_length=500),
        ),
        migrations.AddField(
            model_name="checkpoint",
            name="sha256",
            field=models.CharField(blank=True, default="", max_length=64),
        ),
        migrations.AddField(
            model_name="checkpoint",
            name="size_bytes",
            field=models.BigIntegerField(default=0),
        ),
    ]
