"""JSONL upload pages, under /p/<project_slug>/."""

from django.urls import path

from flywheel.trajectories import upload_views

urlpatterns = [
    path("upload/", upload_views.upload_page, name="upload"),
    path("upload/<int:upload_id>/", upload_views.upload_detail, name="upload_detail"),
    path("upload/<int:upload_id>/retry", upload_views.upload_retry_view, name="upload_retry"),
]
