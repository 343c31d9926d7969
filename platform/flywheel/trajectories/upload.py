"""JSONL upload in the UI: the file is stored as an `Upload`, then ingested line by line through
`ingest.ingest_trajectories`, in chunks, with its progress and per-line errors on the row.

Small files are ingested in the request; larger ones by a Celery task, queued after the row commits. A run
that fails (or a worker that dies mid-file) leaves the upload `failed` (or visibly stuck in `processing`)
with the reason, and Retry runs the whole file again, which is safe because ingestion is an upsert."""

from __future__ import annotations

import io
import logging
from datetime import timedelta

from django.conf import settings
from django.contrib import messages
from django.db import transaction
from django.db.models import F
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from flywheel.accounts.access import project_view
from flywheel.accounts.models import Project, Role
from flywheel.trajectories.ingest import JSONL_CHUNK, IngestResult, ingest_trajectories, jsonl_chunks
from flywheel.trajectories.models import Upload, UploadStatus

logger = logging.getLogger(__name__)

CHUNK_LINES = JSONL_CHUNK  # lines per ingest call (and per progress update)
MAX_KEPT_ERRORS = 500  # per-line errors kept on the row; the count is always exact
INLINE_MAX_BYTES = 512 * 1024  # files up to this size are ingested in the request
STALE_AFTER = timedelta(minutes=15)  # a run in `processing` this long has lost its worker


def max_upload_bytes() -> int:
    return settings.FLYWHEEL_MAX_UPLOAD_BYTES


# --- services --------------------------------------------------------------------------------------------


class UploadRefused(ValueError):
    pass


def upload_create(*, project: Project, filename: str, content: bytes, uploaded_by=None) -> Upload:
    """Store a JSONL file for ingestion and start it: in this call when small, else on a worker."""
    limit = max_upload_bytes()
    if len(content) > limit:
        raise UploadRefused(f"The file is {len(content)} bytes; the limit is {limit} bytes.")
    if not content.strip():
        raise UploadRefused("The file is empty.")
    upload = Upload.objects.create(
        project=project,
        uploaded_by=uploaded_by,
        filename=filename[:255],
        content=content,
        size_bytes=len(content),
        lines_total=sum(1 for line in io.BytesIO(content) if line.strip()),
    )
    if len(content) <= INLINE_MAX_BYTES:
        return upload_process(upload_id=upload.pk)
    _enqueue(upload)
    return upload


def _enqueue(upload: Upload) -> None:
    transaction.on_commit(lambda: _send(upload.pk))


def _send(upload_id: int) -> None:
    from flywheel.trajectories.tasks import upload_process_task

    try:
        upload_process_task.delay(upload_id)
    except Exception as exc:  # the broker is down: say so on the upload, where Retry can send it again
        logger.exception("could not queue upload %s", upload_id)
        Upload.objects.filter(pk=upload_id, status=UploadStatus.QUEUED).update(
            status=UploadStatus.FAILED,
            error=f"Could not queue the upload for a worker: {type(exc).__name__}: {exc}"[:2000],
        )


def upload_is_stale(upload: Upload) -> bool:
    return (
        upload.status == UploadStatus.PROCESSING
        and upload.started_at is not None
        and timezone.now() - upload.started_at > STALE_AFTER
    )


def upload_retry(*, upload: Upload) -> Upload:
    """Run a failed (or stuck) upload again from its first line."""
    if upload.status not in (UploadStatus.FAILED,) and not upload_is_stale(upload):
        raise UploadRefused(f"Only a failed or stuck upload can be retried; this one is {upload.status}.")
    Upload.objects.filter(pk=upload.pk).update(status=UploadStatus.QUEUED, error="")
    upload.refresh_from_db()
    if upload.size_bytes <= INLINE_MAX_BYTES:
        return upload_process(upload_id=upload.pk)
    _enqueue(upload)
    return upload


def upload_process(*, upload_id: int) -> Upload:
    """Ingest the file from its first line; progress and per-line errors are written after each chunk."""
    now = timezone.now()
    # Claim it. `processing` is claimable too: a redelivered task after a worker died mid-file.
    claimed = Upload.objects.filter(
        pk=upload_id, status__in=[UploadStatus.QUEUED, UploadStatus.PROCESSING]
    ).update(
        status=UploadStatus.PROCESSING,
        started_at=now,
        finished_at=None,
        attempts=F("attempts") + 1,
        error="",
        lines_done=0,
        accepted=0,
        created=0,
        updated=0,
        rejected_count=0,
        rejected=[],
    )
    upload = Upload.objects.select_related("project").get(pk=upload_id)
    if not claimed:
        return upload  # done or failed already: nothing to do (a duplicate delivery)
    line_number = 0
    try:
        total = IngestResult()
        kept: list[dict] = []
        for indexes, records in jsonl_chunks(io.BytesIO(upload.content), CHUNK_LINES):
            line_number = indexes[0] + 1
            _ingest_chunk(upload, indexes, records, total, kept)
    except Exception as exc:
        logger.exception("upload %s failed near line %s", upload_id, line_number)
        Upload.objects.filter(pk=upload_id).update(
            status=UploadStatus.FAILED,
            finished_at=timezone.now(),
            error=f"Stopped near line {line_number}: {type(exc).__name__}: {exc}"[:2000],
        )
    else:
        Upload.objects.filter(pk=upload_id).update(status=UploadStatus.DONE, finished_at=timezone.now())
    upload.refresh_from_db()
    return upload


def _ingest_chunk(
    upload: Upload, indexes: list[int], records: list, total: IngestResult, kept: list[dict]
) -> None:
    result = ingest_trajectories(project=upload.project, records=records, source="upload", indexes=indexes)
    total.merge(result)
    for item in result.rejected:
        if len(kept) < MAX_KEPT_ERRORS:
            kept.append({"line": item["index"] + 1, "external_id": item["external_id"], "errors": item["errors"]})
    Upload.objects.filter(pk=upload.pk).update(
        lines_done=F("lines_done") + len(records),
        accepted=total.accepted,
        created=total.created,
        updated=total.updated,
        rejected_count=len(total.rejected),
        rejected=kept,
    )


# --- views -----------------------------------------------------------------------------------------------


@require_http_methods(["GET", "POST"])
@project_view(Role.REVIEWER)
def upload_page(request: HttpRequest, project: Project) -> HttpResponse:
    error = ""
    if request.method == "POST":
        file = request.FILES.get("file")
        if file is None:
            error = "Choose a .jsonl file to upload."
        elif file.size > max_upload_bytes():
            error = f"The file is {file.size} bytes; the limit is {max_upload_bytes()} bytes."
        else:
            try:
                upload = upload_create(
                    project=project, filename=file.name, content=file.read(), uploaded_by=request.user
                )
            except UploadRefused as exc:
                error = str(exc)
            else:
                return redirect("upload_detail", project_slug=project.slug, upload_id=upload.pk)
    uploads = Upload.objects.filter(project=project).defer("content", "rejected")[:20]
    return render(
        request,
        "trajectories/upload.html",
        {"project": project, "uploads": uploads, "error": error, "max_bytes": max_upload_bytes()},
        status=400 if error else 200,
    )


def _upload_for(project: Project, upload_id: int) -> Upload:
    return get_object_or_404(Upload.objects.defer("content"), project=project, pk=upload_id)


@require_GET
@project_view(Role.REVIEWER)
def upload_detail(request: HttpRequest, project: Project, upload_id: int) -> HttpResponse:
    upload = _upload_for(project, upload_id)
    template = "trajectories/_upload_status.html" if request.htmx else "trajectories/upload.html"
    context = {
        "project": project,
        "upload": upload,
        "stale": upload_is_stale(upload),
        "max_bytes": max_upload_bytes(),
    }
    if not request.htmx:
        context["uploads"] = Upload.objects.filter(project=project).defer("content", "rejected")[:20]
    return render(request, template, context)


@require_POST
@project_view(Role.REVIEWER)
def upload_retry_view(request: HttpRequest, project: Project, upload_id: int) -> HttpResponse:
    upload = _upload_for(project, upload_id)
    try:
        upload_retry(upload=upload)
    except UploadRefused as exc:
        messages.error(request, str(exc))
    return redirect("upload_detail", project_slug=project.slug, upload_id=upload.pk)
