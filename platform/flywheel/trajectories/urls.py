"""Review pages and their htmx endpoints, under /p/<project_slug>/."""

from django.urls import path

from flywheel.trajectories import triage_views, views

urlpatterns = [
    path("", views.trajectory_list, name="trajectory_list"),
    path("t/<int:trajectory_id>/", views.trajectory_detail, name="trajectory_detail"),
    path("t/<int:trajectory_id>/outcome", views.trajectory_outcome_set, name="trajectory_outcome_set"),
    path("t/<int:trajectory_id>/comments", views.trajectory_comment_add, name="trajectory_comment_add"),
    path("t/<int:trajectory_id>/tags", views.trajectory_tag_add, name="trajectory_tag_add"),
    path(
        "t/<int:trajectory_id>/tags/<int:tag_id>/remove",
        views.trajectory_tag_remove,
        name="trajectory_tag_remove",
    ),
    path("triage/", triage_views.triage_page, name="triage_page"),
    path("triage/policy", triage_views.triage_policy_save, name="triage_policy_save"),
    path("triage/runs", triage_views.triage_run_start, name="triage_run_start"),
    path("triage/runs/<int:run_id>/", triage_views.triage_run_status, name="triage_run_status"),
]
