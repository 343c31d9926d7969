"""`python manage.py ingest FILE.jsonl --project SLUG`: ingest a JSONL file (one trajectory a line; `-` reads
stdin) through the same service as the API, streaming it in chunks, and report every rejected line."""

from __future__ import annotations

import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from flywheel.accounts.models import Project
from flywheel.trajectories.ingest import IngestResult, ingest_trajectories, jsonl_chunks
from flywheel.trajectories.models import SOURCES


class Command(BaseCommand):
    help = "Ingest trajectories from a JSONL file (one trajectory a line) into a project."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", help="path of the .jsonl file, or - for stdin")
        parser.add_argument("--project", required=True, help="slug of the project")
        parser.add_argument(
            "--source",
            default="cli",
            help=f"recorded as the trajectories' source: one of {', '.join(SOURCES)} (default cli)",
        )
        parser.add_argument(
            "--strict", action="store_true", help="exit with an error when any line is rejected"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # Checked here rather than by argparse `choices`: call_command(source=...) bypasses the parser.
        if options["source"] not in SOURCES:
            raise CommandError(f"--source {options['source']!r} is not one of: {', '.join(SOURCES)}.")
        try:
            project = Project.objects.get(slug=options["project"])
        except Project.DoesNotExist as exc:
            raise CommandError(f"No project {options['project']!r}.") from exc
        try:
            stream = sys.stdin.buffer if options["file"] == "-" else open(options["file"], "rb")
        except OSError as exc:
            raise CommandError(f"Cannot read {options['file']}: {exc}") from exc
        total = IngestResult()
        with stream:
            for indexes, records in jsonl_chunks(stream):
                self._chunk(project, indexes, records, total, options["source"])
        rejected = len(total.rejected)
        self.stdout.write(
            f"{total.accepted} accepted ({total.created} created, {total.updated} updated), {rejected} rejected "
            f"into project {project.slug}"
        )
        if rejected and (options["strict"] or not total.accepted):
            raise CommandError(f"{rejected} line(s) rejected")

    def _chunk(
        self, project: Project, indexes: list[int], records: list[Any], total: IngestResult, source: str
    ) -> None:
        result = ingest_trajectories(project=project, records=records, source=source, indexes=indexes)
        for item in result.rejected:
            for error in item["errors"]:
                where = f"line {item['index'] + 1}"
                if item["external_id"] is not None:
                    where += f" ({item['external_id']})"
                self.stderr.write(f"{where}: {error['field'] or '(the line)'}: {error['message']}")
        total.merge(result)
