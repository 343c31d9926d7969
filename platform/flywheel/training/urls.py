"""Training pages, under /p/<project_slug>/training/."""

from django.urls import path

from flywheel.training import views

urlpatterns = [
    path("training/", views.job_list, name="training_jobs"),
    path("training/new", views.job_new, name="training_job_new"),
    path("training/compare", views.job_compare, name="training_compare"),
    path("training/defaults/clear", views.defaults_clear, name="training_defaults_clear"),
    path("training/<int:job_id>/", views.job_page, name="training_job"),
    path("training/<int:job_id>/checkpoints/<int:step>/", views.checkpoint_page, name="training_checkpoint"),
    path("training/<int:job_id>/curves", views.job_curves, name="training_job_curves"),
    path("training/<int:job_id>/confirm", views.job_confirm, name="training_job_confirm"),
    path("training/<int:job_id>/cancel", views.job_cancel, name="training_job_cancel"),
    path("training/<int:job_id>/retry", views.job_retry, name="training_job_retry"),
]
