"""`manage.py seed_demo`: the admin login, demo project, key and trajectories of `make run` (idempotent)."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from flywheel.seed.announce import access_lines, seeded_lines
from flywheel.seed.demo import demo_seed


class Command(BaseCommand):
    help = "Create the local admin login and a demo project with an API key and demo trajectories."

    def handle(self, *args, **options) -> None:
        seed = demo_seed()
        for line in seeded_lines(seed) + access_lines(seed):
            self.stdout.write(line)
