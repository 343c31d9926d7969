"""`manage.py reseal`: seal every stored secret again under the current SECRET_KEY, the step of a key rotation
between moving the old key to SECRET_KEY_FALLBACKS and dropping it from there (flywheel.sealed)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction

from flywheel.sealed import reseal_stored


class Command(BaseCommand):
    help = ("Seal every stored secret (webhook secrets, judge API keys) again under the current SECRET_KEY, "
            "opening each with SECRET_KEY or SECRET_KEY_FALLBACKS. Run it after a rotation, before the old key "
            "leaves SECRET_KEY_FALLBACKS. Exits with an error, naming them, where a secret no key opens.")

    def handle(self, *args, **options) -> None:
        with transaction.atomic():
            report = reseal_stored(connection)
        for label, count in report.resealed.items():
            self.stdout.write(f"{label}: {count} sealed under the current SECRET_KEY")
        if report.unreadable:
            raise CommandError(
                f"{len(report.unreadable)} secret(s) no key of this server opens, left as they are: "
                f"{', '.join(report.unreadable)}. Put the key they were sealed under in SECRET_KEY_FALLBACKS and "
                "run reseal again, or set those secrets again on their pages.")
        self.stdout.write("Done: the old keys can leave SECRET_KEY_FALLBACKS.")
