from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("projects", "0010_retention_exports")]

    operations: list[migrations.operations.base.Operation] = []
