"""`manage.py leakage_vectors [--project SLUG]`: keep the sentence vector of every request on either side, so
that no reviewer's check waits for the model to run over a side (once, after an upgrade)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from flywheel.accounts.models import Project
from flywheel.evals.leakage import request_vectors_fill


class Command(BaseCommand):
    help = "Compute the leakage guard's request vectors that are not kept yet."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--project", default=None, help="a project's slug (default: every project)")

    def handle(self, *args, project: str | None, **options) -> None:
        projects = None
        if project is not None:
            projects = list(Project.objects.filter(slug=project))
            if not projects:
                raise CommandError(f"no project with slug {project!r}")
        self.stdout.write(f"{request_vectors_fill(projects=projects)} request vector(s) computed")
