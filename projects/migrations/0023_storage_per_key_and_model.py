from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("projects", "0022_stored_completions")]

    operations = [
        migrations.AddField(
            model_name="team",
            name="completion_storage_models",
            field=models.JSONField(blank=True, default=dict),
        ),
        migrations.AddField(
            model_name="apikey",
            name="completion_storage",
            field=models.CharField(blank=True, default="", max_length=16),
        ),
    ]
