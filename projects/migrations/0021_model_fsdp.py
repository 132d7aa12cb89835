from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("projects", "0020_model_devices"),
    ]

    operations = [
        migrations.AddField(
            model_name="trainablemodel",
            name="fsdp",
            field=models.BooleanField(
                default=False, help_text="its client training jobs shard the base across their devices (FSDP2)"
            ),
        ),
    ]
