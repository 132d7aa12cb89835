from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("projects", "0012_queues")]

    operations: list[migrations.operations.base.Operation] = []
