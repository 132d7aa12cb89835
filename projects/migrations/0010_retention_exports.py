import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("projects", "0009_storage"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name="trainablemodel",
            name="retention",
            field=models.JSONField(
                blank=True,
                default=dict,
                help_text="checkpoints kept after every step: {keep_last: N, keep_best: {metric, n}}; {} keeps all",
            ),
        ),
        migrations.CreateModel(
            name="Export",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("error", models.TextField(blank=True, default="")),
                ("worker", models.CharField(blank=True, default="", max_length=200)),
                (
                    "attempts",
                    models.PositiveIntegerField(default=0, help_text="how many times a worker claimed it"),
                ),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("started_at", models.DateTimeField(blank=True, null=True)),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                ("format", models.CharField(choices=[("merged", "Merged")], default="merged", max_length=16)),
                (
                    "status",
                    models.CharField(
                        choices=[
                            ("queued", "Queued"),
                            ("running", "Running"),
                            ("succeeded", "Succeeded"),
                            ("failed", "Failed"),
                        ],
                        default="queued",
                        max_length=16,
                    ),
                ),
                (
                    "key",
                    models.CharField(
                        blank=True, default="", help_text="storage key of the folder", max_length=1000
                    ),
                ),
                ("size_bytes", models.PositiveBigIntegerField(default=0)),
                ("seconds", models.FloatField(blank=True, help_text="how long the merge took", null=True)),
                ("heartbeat_at", models.DateTimeField(blank=True, null=True)),
                (
                    "checkpoint",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="exports",
                        to="projects.checkpoint",
                    ),
                ),
                (
                    "created_by",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={
                "ordering": ["-id"],
                "abstract": False,
                "indexes": [
                    models.Index(fields=["status", "heartbeat_at"], name="projects_ex_status_ead635_idx")
                ],
            },
        ),
    ]
