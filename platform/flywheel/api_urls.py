"""The JSON API (django-ninja), mounted at /api/v1/; its schema is at /api/v1/openapi.json."""

from django.urls import path

from flywheel.api import api

urlpatterns = [path("", api.urls)]
