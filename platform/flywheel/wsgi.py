"""WSGI entry point (gunicorn flywheel.wsgi; runserver takes it from WSGI_APPLICATION)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "flywheel.settings")
application = get_wsgi_application()

# Load the URLconf now (every app's views and API routers: about 0.8 s), so that the first request a process
# serves is not the one that pays for it.
from django.urls import get_resolver  # noqa: E402

get_resolver().url_patterns  # noqa: B018
