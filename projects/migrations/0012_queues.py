from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("projects", "0011_run_control")]

    operations: list[migrations.operations.base.Operation] = []
