"""`manage.py seed_demo`: the admin login, demo project, key and trajectories of `make run` (idempotent)."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from flywheel.registry.models import BaseModel
from flywheel.seed.demo import demo_seed
from flywheel.training.demo import LOOP_SLUG


class Command(BaseCommand):
    help = "Create the local admin login and a demo project with an API key and demo trajectories."

    def handle(self, *args, **options) -> None:
        seed = demo_seed()
        self.stdout.write(
            f"Demo project {seed.project.slug}: {seed.created} trajectories created, {seed.updated} updated"
            + (f", {seed.rejected} rejected" if seed.rejected else "")
        )
        self.stdout.write(f"Admin login: username {seed.username}  password {seed.password}")
        if seed.password_changed:
            self.stdout.write("  (that password was changed since; use the one you set)")
        if not BaseModel.objects.filter(project__slug=LOOP_SLUG).exists():
            self.stdout.write(
                f"Loop demo (project {LOOP_SLUG}): the worker is building the tiny model and playing it on workplace "
                "requests (a few minutes on a CPU); its failures, task set and suites appear when it is done."
            )
        self.stdout.write(f"Demo API key (project {seed.project.slug}, scopes ingest,read): {seed.api_key}")
