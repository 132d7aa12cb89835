from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("projects", "0009_storage")]

    operations: list[migrations.operations.base.Operation] = []
