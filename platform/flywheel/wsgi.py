"""WSGI entry point (gunicorn flywheel.wsgi; runserver takes it from WSGI_APPLICATION)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "flywheel.settings")
application = get_wsgi_application()

# Load the URLconf now (every app's views and API routers: about 0.8 s), so that the first request a process
# serves is not the one that pays for it.
from django.urls import get_resolver  # noqa: E402

get_resolver().url_patterns  # noqa: B018

# The leakage guard's sentence model, loaded beside the first requests instead of inside the first promotion
# check (a request that needs it meanwhile waits for the load under the model's lock, no longer).
from django.conf import settings  # noqa: E402

if settings.FLYWHEEL_PRELOAD_SENTENCE_MODEL:
    from flywheel.failures.clustering.embedding import preload_shared_model  # noqa: E402

    preload_shared_model()
