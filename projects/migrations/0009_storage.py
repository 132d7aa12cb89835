from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("projects", "0008_training_jobs")]

    operations: list[migrations.operations.base.Operation] = []
