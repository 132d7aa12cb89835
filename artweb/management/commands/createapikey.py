from django.core.management.base import BaseCommand, CommandError

from projects import services
from projects.errors import DomainError
from projects.models import Team


class Command(BaseCommand):
    help = "Create a team API key and print it once (bootstrap access for CI or an operator)."

    def add_arguments(self, parser):
        parser.add_argument("--team", required=True)
        parser.add_argument("--create-team", action="store_true", help="create the team if it does not exist")
        parser.add_argument("--read-only", action="store_true")
        parser.add_argument("--name", default="created by createapikey")

    def handle(self, *args, team: str, create_team: bool, read_only: bool, name: str, **options):
        try:
            team_obj = Team.objects.filter(name=team).first()
            if team_obj is None:
                if not create_team:
                    raise CommandError(f"no team named {team!r} (pass --create-team to create it)")
                team_obj = services.team_create(name=team)
            created = services.api_key_create(team=team_obj, name=name, read_only=read_only)
        except DomainError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(created.plaintext)
