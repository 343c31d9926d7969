"""The review pages (the trajectory list and page), failure-mode pages, assignment endpoints and the review
queue, under /p/<project_slug>/."""

from django.urls import path

from flywheel.failures import review_views, views

urlpatterns = [
    path("", review_views.trajectory_list, name="trajectory_list"),
    path("t/<int:trajectory_id>/", review_views.trajectory_detail, name="trajectory_detail"),
    path("t/<int:trajectory_id>/outcome", review_views.trajectory_outcome_set, name="trajectory_outcome_set"),
    path("t/<int:trajectory_id>/comments", review_views.trajectory_comment_add, name="trajectory_comment_add"),
    path("t/<int:trajectory_id>/tags", review_views.trajectory_tag_add, name="trajectory_tag_add"),
    path("t/<int:trajectory_id>/tags/<int:tag_id>/remove", review_views.trajectory_tag_remove,
         name="trajectory_tag_remove"),
    path("failures/", views.failure_mode_list, name="failure_mode_list"),
    path("failures/new", views.failure_mode_create, name="failure_mode_create"),
    path("failures/<int:mode_id>/", views.failure_mode_detail, name="failure_mode_detail"),
    path("failures/<int:mode_id>/edit", views.failure_mode_update, name="failure_mode_update"),
    path("failures/<int:mode_id>/delete", views.failure_mode_delete, name="failure_mode_delete"),
    path("failures/bulk-assign", views.bulk_assign, name="failure_mode_bulk_assign"),
    path("taxonomy/", views.taxonomy_page, name="taxonomy_page"),
    path("taxonomy/categories", views.taxonomy_category_create, name="taxonomy_category_create"),
    path("taxonomy/<int:category_id>/edit", views.taxonomy_category_update, name="taxonomy_category_update"),
    path("taxonomy/<int:category_id>/delete", views.taxonomy_category_delete, name="taxonomy_category_delete"),
    path("t/<int:trajectory_id>/modes", views.trajectory_mode_assign, name="trajectory_mode_assign"),
    path(
        "t/<int:trajectory_id>/modes/<int:mode_id>/remove",
        views.trajectory_mode_unassign,
        name="trajectory_mode_unassign",
    ),
    path("queue/", views.queue_page, name="queue_page"),
    path("queue/claim", views.queue_claim, name="queue_claim"),
    path("queue/undo", views.queue_undo, name="queue_undo"),
    path("queue/skips/clear", views.queue_skips_clear, name="queue_skips_clear"),
    path("queue/<int:trajectory_id>/assign", views.queue_assign, name="queue_assign"),
    path("queue/<int:trajectory_id>/modes/<int:mode_id>/remove", views.queue_unassign, name="queue_unassign"),
    path("queue/<int:trajectory_id>/complete", views.queue_complete, name="queue_complete"),
    path("queue/<int:trajectory_id>/skip", views.queue_skip, name="queue_skip"),
]
