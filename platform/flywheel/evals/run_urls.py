"""Eval run pages, under /p/<project_slug>/evals/runs/."""

from django.urls import path

from flywheel.evals import run_views

urlpatterns = [
    path("evals/runs/", run_views.run_list, name="eval_runs"),
    path("evals/runs/new", run_views.run_start, name="eval_run_start"),
    path("evals/runs/compare", run_views.run_compare, name="eval_run_compare"),
    path("evals/runs/<int:eval_run_id>/", run_views.run_page, name="eval_run"),
    path("evals/runs/<int:eval_run_id>/cancel", run_views.run_cancel, name="eval_run_cancel"),
    path("evals/runs/<int:eval_run_id>/retry", run_views.run_retry, name="eval_run_retry"),
]
