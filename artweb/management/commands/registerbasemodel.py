from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from projects import services
from projects.jobs.queues import base_model_queue
from projects.queues import queue_name_problem
from training.model_files import BUNDLED_MODEL


class Command(BaseCommand):
    help = (
        f"Add or update a base model in the catalogue. SOURCE is {BUNDLED_MODEL} or a local model directory."
    )

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("source")
        parser.add_argument("--description", default="")
        parser.add_argument(
            "--queue",
            default=None,
            help="Celery queue its runs, evaluations and training jobs go to, one per GPU class "
            "(e.g. gpu-small, gpu-large, cpu); workers subscribe with `celery -A artweb worker -Q NAME`. "
            "Default: keep the current one (a new model: WORK_QUEUE_DEFAULT); '' resets to that default.",
        )

    def handle(self, *args, name: str, source: str, description: str, queue: str | None, **options):
        if queue and (problem := queue_name_problem(queue)):
            raise CommandError(f"--queue {queue!r}: {problem}")
        if source != BUNDLED_MODEL and not (Path(source) / "config.json").is_file():
            raise CommandError(f"{source!r} is neither {BUNDLED_MODEL} nor a directory with a config.json")
        model = services.base_model_register(name=name, source=source, description=description, queue=queue)
        self.stdout.write(f"base model {model.name} -> {model.source} (queue {base_model_queue(model)})")
