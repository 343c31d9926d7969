"""`manage.py create_project SLUG --owner USERNAME`: a project whose owner is its first maintainer."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from flywheel.accounts.models import Project
from flywheel.accounts.services import project_create


class Command(BaseCommand):
    help = "Create a project (one per agent); the owner becomes its maintainer."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("slug", help="short name used in URLs, e.g. support-agent")
        parser.add_argument("--owner", required=True, help="username of an existing user; becomes maintainer")
        parser.add_argument("--name", default="", help="display name (default: the slug)")
        parser.add_argument("--description", default="")

    def handle(self, *args, slug: str, owner: str, name: str, description: str, **options) -> None:
        user = get_user_model().objects.filter(username=owner).first()
        if user is None:
            raise CommandError(f"no user named {owner!r} (create one with `manage.py createsuperuser`)")
        if Project.objects.filter(slug=slug).exists():
            raise CommandError(f"a project with slug {slug!r} exists already")
        try:
            project = project_create(slug=slug, name=name, owner=user, description=description)
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"Created project {project.slug} ({project.name}); {user.get_username()} is maintainer.")
