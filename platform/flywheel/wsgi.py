"""WSGI entry point (gunicorn flywheel.wsgi; runserver takes it from WSGI_APPLICATION)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "flywheel.settings")
application = get_wsgi_application()

# Load the URLconf now (every app's views and API routers: about 0.8 s), so that the first request a process
# serves is not the one that pays for it.
from django.urls import get_resolver  # noqa: E402

get_resolver().url_patterns  # noqa: B018

# The leakage guard's sentence model and the MLflow client, loaded beside the first requests instead of inside
# the first promotion check and the first Promote (a request that needs one meanwhile waits for what is left).
from django.conf import settings  # noqa: E402

if settings.FLYWHEEL_PRELOAD:
    from flywheel.failures.clustering.embedding import preload_shared_model  # noqa: E402
    from flywheel.registry.mlflow_bridge import preload_client  # noqa: E402

    preload_client()
    preload_shared_model()
