"""What `make run` and `manage.py seed_demo` tell a person about the demo they seeded: what was made, and how to
get in (the login and the key), the latter printed last by `make run`, beside the address, once it serves."""

from __future__ import annotations

from flywheel.registry.models import BaseModel
from flywheel.seed.demo import DemoSeed
from flywheel.training.demo import LOOP_SLUG


def seeded_lines(seed: DemoSeed) -> list[str]:
    """What the seeding made, and what the worker goes on making."""
    lines = [f"Demo project {seed.project.slug}: {seed.created} trajectories created, {seed.updated} updated"
             + (f", {seed.rejected} rejected" if seed.rejected else "")]
    if not BaseModel.objects.filter(project__slug=LOOP_SLUG).exists():
        lines.append(f"Loop demo (project {LOOP_SLUG}): the worker copies the shipped demo model and plays it on "
                     "workplace requests (a minute or two on a CPU); its failures, task set and suites appear "
                     "when it is done.")
    return lines


def access_lines(seed: DemoSeed) -> list[str]:
    """The login and the demo key."""
    lines = [f"Admin login: username {seed.username}  password {seed.password}"]
    if seed.password_changed:
        lines.append("  (that password was changed since; use the one you set)")
    lines.append(f"Demo API key (project {seed.project.slug}, scopes ingest,read): {seed.api_key}")
    return lines
