"""The "Connect your agent" page, under /p/<project_slug>/."""

from django.urls import path

from flywheel.trajectories import connect

urlpatterns = [
    path("connect/", connect.connect_page, name="connect"),
]
