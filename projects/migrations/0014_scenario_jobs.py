import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("projects", "0013_webhooks"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="ScenarioJob",
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
                ("name", models.CharField(help_text="name of the task set it makes", max_length=63)),
                ("instruction", models.TextField()),
                ("model", models.CharField(help_text="the model called at the endpoint", max_length=200)),
                ("validation_fraction", models.FloatField(default=0.0)),
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
                ("rows_done", models.PositiveIntegerField(default=0, help_text="rows accepted so far")),
                ("rows_total", models.PositiveIntegerField(help_text="rows asked for")),
                ("requests_done", models.PositiveIntegerField(default=0)),
                (
                    "problems",
                    models.JSONField(
                        blank=True, default=list, help_text="[[where, message]] when no row was valid"
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
                (
                    "endpoint",
                    models.ForeignKey(
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to="projects.judgeendpoint",
                    ),
                ),
                (
                    "environment",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to="projects.environment",
                    ),
                ),
                (
                    "project",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="scenario_jobs",
                        to="projects.project",
                    ),
                ),
                (
                    "task_set",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to="projects.taskset",
                    ),
                ),
            ],
            options={"ordering": ["-id"], "abstract": False},
        ),
    ]
