"""The Clusters page and its actions, under /p/<project_slug>/."""

from django.urls import path

from flywheel.failures.clustering import views

urlpatterns = [
    path("clusters/", views.clusters_page, name="clusters_page"),
    path("clusters/runs", views.clustering_run_start, name="clustering_run_start"),
    path("clusters/runs/<int:clustering_id>/", views.clustering_run_status, name="clustering_run_status"),
    path("clusters/runs/<int:clustering_id>/retry", views.clustering_run_retry, name="clustering_run_retry"),
    path("clusters/s/<int:suggestion_id>/accept", views.suggestion_accept, name="cluster_suggestion_accept"),
    path("clusters/s/<int:suggestion_id>/merge", views.suggestion_merge, name="cluster_suggestion_merge"),
    path("clusters/s/<int:suggestion_id>/split", views.suggestion_split, name="cluster_suggestion_split"),
    path("clusters/s/<int:suggestion_id>/dismiss", views.suggestion_dismiss, name="cluster_suggestion_dismiss"),
]
