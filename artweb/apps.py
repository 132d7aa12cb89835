from django.apps import AppConfig


class ArtwebConfig(AppConfig):
    """Holds the platform-wide management commands (demo, up)."""

    name = "artweb"
