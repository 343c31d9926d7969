"""URL map: pages per project under /p/<slug>/, the JSON API under /api/v1/."""

from django.contrib import admin
from django.http import HttpRequest, JsonResponse
from django.urls import include, path


def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("admin/", admin.site.urls),
    path("api/v1/", include("flywheel.api_urls")),
    path("", include("flywheel.accounts.urls")),
    path("p/<slug:project_slug>/", include("flywheel.trajectories.urls")),
    path("p/<slug:project_slug>/", include("flywheel.trajectories.upload_urls")),
    path("p/<slug:project_slug>/", include("flywheel.trajectories.connect_urls")),
    path("p/<slug:project_slug>/", include("flywheel.failures.urls")),
    path("p/<slug:project_slug>/", include("flywheel.failures.clustering.urls")),
    path("p/<slug:project_slug>/", include("flywheel.evals.urls")),
    path("p/<slug:project_slug>/", include("flywheel.environments.urls")),
    path("p/<slug:project_slug>/", include("flywheel.registry.urls")),
    path("p/<slug:project_slug>/", include("flywheel.training.urls")),
    path("p/<slug:project_slug>/", include("flywheel.evals.run_urls")),
    path("p/<slug:project_slug>/", include("flywheel.dashboard.urls")),
]
