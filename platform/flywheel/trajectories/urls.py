"""Review pages and their htmx endpoints, under /p/<project_slug>/."""

from django.urls import path

from flywheel.trajectories import views

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
]
