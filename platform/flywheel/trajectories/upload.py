"""JSONL upload in the UI: the file is stored as an `Upload`, then ingested line by line through
`ingest.ingest_trajectories`, in chunks, with its progress and per-line errors on the row.

Small files are ingested in the request; larger ones by a Celery task, sent after the row commits. The row
is its own outbox (`flywheel.outbox`): an upload still `queued` after FLYWHEEL_REQUEUE_AFTER_S (the broker
was down, the message was lost) is sent again by the sweep, and Retry sends it too.

A run holds the upload by a lease (its owner and an expiry, renewed with every chunk). It claims the upload
with a compare-and-set (queued, or processing with an expired lease), and writes each chunk, its counters and
its end only while the lease is still its own, checked in the chunk's transaction with the row locked. So a
message delivered twice runs once, and when a stuck run's upload is taken over (by Retry or the sweep), the
old run stops at its next chunk without writing, even if it was only slow. Running the whole file again is
safe because ingestion is an upsert. The pages are in `upload_views`."""

from __future__ import annotations

import io
import logging
import os
import socket
import uuid
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.template.defaultfilters import filesizeformat
from django.utils import timezone

from flywheel import outbox, runs, timelimits
from flywheel.accounts.models import Project
from flywheel.supervise import Refused, worker_name
from flywheel.trajectories.ingest import (
    JSONL_CHUNK,
    IngestResult,
    ingest_trajectories,
    jsonl_chunks,
    sender_of_user,
)
from flywheel.trajectories.models import Upload, UploadStatus

logger = logging.getLogger(__name__)

CHUNK_LINES = JSONL_CHUNK  # lines per ingest call (and per progress update and lease renewal)
MAX_KEPT_ERRORS = 500  # per-line errors kept on the row; the count is always exact
INLINE_MAX_BYTES = 512 * 1024  # files up to this size are ingested in the request


def max_upload_bytes() -> int:
    return settings.FLYWHEEL_MAX_UPLOAD_BYTES


def lease_length() -> timedelta:
    return timedelta(seconds=settings.FLYWHEEL_UPLOAD_LEASE_S)


# --- services --------------------------------------------------------------------------------------------


def too_big(size: int) -> str:
    """The refusal of a file over the limit, in the units a person reads (MB, not bytes)."""
    return f"The file is {filesizeformat(size)}; the limit is {filesizeformat(max_upload_bytes())}."


class UploadRefused(Refused):
    """A file the upload does not take (too big, empty)."""


class LeaseLost(Exception):
    """Another run holds the upload now; this one stops without writing."""


def upload_create(*, project: Project, filename: str, content: bytes, uploaded_by=None) -> Upload:
    """Store a JSONL file for ingestion and start it: in this call when small, else on a worker."""
    limit = max_upload_bytes()
    if len(content) > limit:
        raise UploadRefused(too_big(len(content)))
    if not content.strip():
        raise UploadRefused("The file is empty.")
    if content.lstrip()[:1] == b"[":
        # One JSON array parses as no line at all: every line of it would be rejected one by one.
        raise UploadRefused("The file is one JSON array; upload JSONL, one trajectory a line "
                            "(`jq -c '.[]' file.json > file.jsonl` turns the one into the other).")
    upload = Upload.objects.create(
        project=project,
        uploaded_by=uploaded_by,
        filename=filename[:255],
        content=content,
        size_bytes=len(content),
        lines_total=sum(1 for line in io.BytesIO(content) if line.strip()),
        queued_at=timezone.now(),
    )
    if len(content) <= INLINE_MAX_BYTES:
        return upload_process(upload_id=upload.pk)
    _enqueue(upload.pk)
    return upload


def _enqueue(upload_id: int) -> None:
    from flywheel.trajectories.tasks import upload_process_task  # tasks import this module

    outbox.send_on_commit(upload_process_task, upload_id)


def upload_retry(*, upload: Upload) -> Upload:
    """Run a failed, stuck or long-waiting upload again from its first line.

    The row lock decides: of two retries at once, or a retry and a sweep, one requeues the upload, and a run
    whose lease expired loses it here (it stops at its next chunk)."""
    from flywheel.trajectories.tasks import upload_process_task  # tasks import this module

    inline = upload.size_bytes <= INLINE_MAX_BYTES
    upload = runs.run_retry(upload, task=None if inline else upload_process_task)
    return upload_process(upload_id=upload.pk) if inline else upload


def upload_sweep() -> int:
    """Send again every upload no run is on (flywheel.outbox): queued too long, or its run's lease expired.

    An upload whose runs lost their worker Upload.LOST_WORKER_ATTEMPTS times is marked failed instead (a file that kills its
    worker must not do so forever); Retry runs it again. Returns how many were sent."""
    from flywheel.trajectories.tasks import upload_process_task  # tasks import this module

    return runs.run_sweep(Upload, task=upload_process_task)


def _run_owner() -> str:
    """Who runs: the host and process (for a person reading the row) and a unique run id."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def upload_claim(*, upload_id: int, owner: str | None = None) -> str | None:
    """Take the upload for a run (queued, or processing under an expired lease): its lease owner, or None
    when another run holds it or it is finished (a duplicate delivery)."""
    owner = owner or _run_owner()
    now = timezone.now()
    claimed = Upload.objects.filter(
        Q(status=UploadStatus.QUEUED) | Q(status=UploadStatus.PROCESSING, lease_expires_at__lt=now),
        pk=upload_id,
    ).update(
        status=UploadStatus.PROCESSING,
        lease_owner=owner,
        lease_expires_at=now + lease_length(),
        worker=worker_name(),
        heartbeat_at=now,
        started_at=now,
        finished_at=None,
        attempt=F("attempt") + 1,
        error="",
        lines_done=0,
        accepted=0,
        created=0,
        updated=0,
        rejected_count=0,
        rejected=[],
    )
    return owner if claimed else None


def upload_process(*, upload_id: int, owner: str | None = None) -> Upload:
    """Claim the upload and ingest the file from its first line (see `upload_run`)."""
    owner = upload_claim(upload_id=upload_id, owner=owner)
    if owner is None:
        return Upload.objects.select_related("project").get(pk=upload_id)
    return upload_run(upload_id=upload_id, owner=owner)


def upload_run(*, upload_id: int, owner: str) -> Upload:
    """Ingest the file of an upload claimed by `owner`; progress and per-line errors after each chunk. Stops
    without writing as soon as the lease is another run's."""
    upload = Upload.objects.select_related("project").get(pk=upload_id)
    line_number = 0
    try:
        total = IngestResult()
        kept: list[dict] = []
        for indexes, records in jsonl_chunks(io.BytesIO(upload.content), CHUNK_LINES):
            line_number = indexes[0] + 1
            _ingest_chunk(upload, owner, indexes, records, total, kept)
    except LeaseLost:
        logger.warning("upload %s: run %s lost its lease near line %s; it stops", upload_id, owner, line_number)
    except Exception as exc:
        logger.exception("upload %s failed near line %s", upload_id, line_number)
        _finish(upload_id, owner, UploadStatus.FAILED, f"Stopped near line {line_number}: {timelimits.stopped_reason(exc)}")
    else:
        _finish(upload_id, owner, UploadStatus.DONE)
    upload.refresh_from_db()
    return upload


def _held(upload_id: int, owner: str) -> Q:
    return Q(pk=upload_id, status=UploadStatus.PROCESSING, lease_owner=owner)


def _ingest_chunk(
    upload: Upload, owner: str, indexes: list[int], records: list, total: IngestResult, kept: list[dict]
) -> None:
    with transaction.atomic():
        # The row stays locked until this chunk commits: a takeover waits for it, then finds the lease renewed.
        if not Upload.objects.select_for_update().filter(_held(upload.pk, owner)).exists():
            raise LeaseLost
        result = ingest_trajectories(project=upload.project, records=records, source="upload", indexes=indexes,
                                     ingested_by=sender_of_user(upload.uploaded_by_id))
        total.merge(result)
        for item in result.rejected:
            if len(kept) < MAX_KEPT_ERRORS:
                kept.append({"line": item["index"] + 1, "external_id": item["external_id"], "errors": item["errors"]})
        Upload.objects.filter(_held(upload.pk, owner)).update(
            lines_done=F("lines_done") + len(records),
            accepted=total.accepted,
            created=total.created,
            updated=total.updated,
            rejected_count=len(total.rejected),
            rejected=kept,
            heartbeat_at=timezone.now(),
            lease_expires_at=timezone.now() + lease_length(),
        )


def _finish(upload_id: int, owner: str, status: str, error: str = "") -> None:
    """The end of a run, written only while its lease holds (a run that lost it leaves the row to the winner)."""
    Upload.objects.filter(_held(upload_id, owner)).update(
        status=status, finished_at=timezone.now(), lease_expires_at=None, error=error[:2000]
    )
