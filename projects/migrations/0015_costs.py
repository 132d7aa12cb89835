from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("projects", "0014_webhooks")]

    operations: list[migrations.operations.base.Operation] = []
