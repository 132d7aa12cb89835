from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from projects import services
from training.base_models import BUNDLED_MODEL


class Command(BaseCommand):
    help = (
        f"Add or update a base model in the catalogue. SOURCE is {BUNDLED_MODEL} or a local model directory."
    )

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("source")
        parser.add_argument("--description", default="")

    def handle(self, *args, name: str, source: str, description: str, **options):
        if source != BUNDLED_MODEL and not (Path(source) / "config.json").is_file():
            raise CommandError(f"{source!r} is neither {BUNDLED_MODEL} nor a directory with a config.json")
        model = services.base_model_register(name=name, source=source, description=description)
        self.stdout.write(f"base model {model.name} -> {model.source}")
