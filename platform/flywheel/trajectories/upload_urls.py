"""JSONL upload pages, under /p/<project_slug>/."""

from django.urls import path

from flywheel.trajectories import upload

urlpatterns = [
    path("upload/", upload.upload_page, name="upload"),
    path("upload/<int:upload_id>/", upload.upload_detail, name="upload_detail"),
    path("upload/<int:upload_id>/retry", upload.upload_retry_view, name="upload_retry"),
]
