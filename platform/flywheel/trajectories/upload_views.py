"""The JSONL upload pages: upload a file, follow its progress (an htmx partial), retry it. Thin: the work is
in the services of `upload`."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from flywheel.accounts.access import project_view
from flywheel.accounts.models import Project, Role
from flywheel.supervise import Refused
from flywheel.trajectories import upload as services
from flywheel.trajectories.models import Upload


@require_http_methods(["GET", "POST"])
@project_view(Role.REVIEWER)
def upload_page(request: HttpRequest, project: Project) -> HttpResponse:
    error = ""
    if request.method == "POST":
        file = request.FILES.get("file")
        if file is None:
            error = "Choose a .jsonl file to upload."
        elif file.size > services.max_upload_bytes():
            error = services.too_big(file.size)
        else:
            try:
                upload = services.upload_create(
                    project=project, filename=file.name, content=file.read(), uploaded_by=request.user
                )
            except services.UploadRefused as exc:
                error = str(exc)
            else:
                return redirect("upload_detail", project_slug=project.slug, upload_id=upload.pk)
    uploads = Upload.objects.filter(project=project).defer("content", "rejected")[:20]
    return render(
        request,
        "trajectories/upload.html",
        {"project": project, "uploads": uploads, "error": error, "max_bytes": services.max_upload_bytes()},
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
        "stale": upload.stale,
        "waiting_long": upload.waiting_long,
        "max_bytes": services.max_upload_bytes(),
    }
    if not request.htmx:
        context["uploads"] = Upload.objects.filter(project=project).defer("content", "rejected")[:20]
    response = render(request, template, context)
    if request.htmx and not upload.active:
        # The poll's last answer: the list of recent uploads below still shows the status it was drawn with.
        response["HX-Trigger"] = "upload-finished"
    return response


@require_POST
@project_view(Role.REVIEWER)
def upload_retry_view(request: HttpRequest, project: Project, upload_id: int) -> HttpResponse:
    upload = _upload_for(project, upload_id)
    try:
        services.upload_retry(upload=upload)
    except Refused as exc:
        messages.error(request, str(exc))
    return redirect("upload_detail", project_slug=project.slug, upload_id=upload.pk)
