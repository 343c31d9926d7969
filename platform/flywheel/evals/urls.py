"""Eval-suite pages, promotion and calibration, under /p/<project_slug>/."""

from django.urls import path

from flywheel.evals import online_views, recurrence_views, views


def suite(view):  # noqa: ANN001, ANN201 - a URLconf helper
    return views.for_kind(view, "suite")


urlpatterns = [
    # Loaded by htmx from a failure mode's page: the mode's rate per version (flywheel.evals.recurrence).
    path("models/failure-modes/<int:mode_id>/versions", recurrence_views.failure_mode_versions,
         name="registry_failure_mode_versions"),
    path("evals/", suite(views.collection_list), name="suite_list"),
    path("evals/new", suite(views.collection_create), name="suite_create"),
    path("evals/<int:suite_id>/", suite(views.collection_detail), name="suite_detail"),
    path("evals/<int:suite_id>/cases/<int:case_id>/remove", suite(views.item_remove), name="suite_item_remove"),
    path("evals/<int:suite_id>/from-production", suite(views.regression_build), name="suite_regression_build"),
    path("evals/<int:suite_id>/v/<int:number>/", suite(views.version_detail), name="suite_version"),
    path("evals/<int:suite_id>/v/<int:number>.jsonl", suite(views.version_export), name="suite_export"),
    path("evals/<int:suite_id>/v/<int:number>/freeze", suite(views.version_freeze), name="suite_freeze"),
    path("evals/calibration/", views.calibration_page, name="calibration"),
    path("evals/calibration/runs", views.calibration_start, name="calibration_start"),
    path("evals/calibration/runs/<int:calibration_id>/", views.calibration_status, name="calibration_status"),
    path("online-eval/", online_views.online_eval_page, name="online_eval"),
    path("online-eval/settings", online_views.online_eval_save, name="online_eval_save"),
    path("t/<int:trajectory_id>/promote", views.promotion_form, name="promotion_form"),
    path("promote/", views.bulk_promotion, name="bulk_promotion"),
]
