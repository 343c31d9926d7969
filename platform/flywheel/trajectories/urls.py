"""Triage pages under /p/<project_slug>/ (the review pages are the failures app's: flywheel.failures.urls)."""

from django.urls import path

from flywheel.trajectories import triage_views

urlpatterns = [
    path("triage/", triage_views.triage_page, name="triage_page"),
    path("triage/policy", triage_views.triage_policy_save, name="triage_policy_save"),
    path("triage/runs", triage_views.triage_run_start, name="triage_run_start"),
    path("triage/runs/<int:run_id>/", triage_views.triage_run_status, name="triage_run_status"),
    path("triage/runs/<int:run_id>/retry", triage_views.triage_run_retry, name="triage_run_retry"),
]
