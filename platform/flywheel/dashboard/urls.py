"""The flywheel dashboard, under /p/<project_slug>/."""

from django.urls import path

from flywheel.dashboard import views

urlpatterns = [
    path("dashboard/", views.dashboard_page, name="flywheel_dashboard"),
]
