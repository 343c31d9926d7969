"""Settings of the Celery worker that `tests/conftest.py` starts: the platform's, plus the test session's
broker options (its own folders, or its own key prefix on a shared Redis)."""

import json
import os

from flywheel.settings import *  # noqa: F403

CELERY_BROKER_TRANSPORT_OPTIONS = json.loads(os.environ["FLYWHEEL_TEST_BROKER_OPTIONS"])
