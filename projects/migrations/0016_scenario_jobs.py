from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("projects", "0015_costs")]

    operations: list[migrations.operations.base.Operation] = []
