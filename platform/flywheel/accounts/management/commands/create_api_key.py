"""`manage.py create_api_key --project SLUG [--scopes ingest,read]`: prints the new key on its last line."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from flywheel.accounts.models import Project, Scope
from flywheel.accounts.services import api_key_create


class Command(BaseCommand):
    help = "Create an API key for a project. The key is printed once, on the last line; only its hash is kept."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--project", required=True, help="project slug")
        parser.add_argument(
            "--scopes", default="ingest,read", help=f"comma-separated, of {', '.join(Scope.values)} (default: both)"
        )
        parser.add_argument("--name", default="", help="a label to tell keys apart (default: 'cli key')")

    def handle(self, *args, project: str, scopes: str, name: str, **options) -> None:
        target = Project.objects.filter(slug=project).first()
        if target is None:
            raise CommandError(f"no project with slug {project!r}")
        wanted = [s.strip() for s in scopes.split(",") if s.strip()]
        unknown = sorted(set(wanted) - set(Scope.values))
        if unknown or not wanted:
            raise CommandError(
                f"unknown scope(s) {', '.join(unknown) or '(none given)'}: choose from {', '.join(Scope.values)}"
            )
        issued = api_key_create(project=target, name=name or "cli key", scopes=wanted)
        self.stdout.write(
            f"API key {issued.api_key.prefix} for {target.slug}, scopes {','.join(issued.api_key.scopes)}. "
            "It is shown only now; store it safely:"
        )
        self.stdout.write(issued.raw_key)
