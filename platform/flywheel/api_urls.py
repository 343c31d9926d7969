"""The JSON API (django-ninja), mounted at /api/v1/; its schema is at /api/v1/openapi.json.

The top floor of the API: each app's API modules define routers and import only the shared package
(flywheel.api); this module imports them and adds them to `api`, so imports point one way. The order of the
routers is the order of the schema's paths."""

from django.urls import path

from flywheel.api import api, meta_router
from flywheel.environments import api as environments_api
from flywheel.evals import api as evals_api
from flywheel.evals import online_api as online_eval_api
from flywheel.evals import run_api as eval_runs_api
from flywheel.failures import api as failures_api
from flywheel.failures.clustering import api as clustering_api
from flywheel.registry import api as registry_api
from flywheel.registry import live_api
from flywheel.training import api as training_api
from flywheel.trajectories import api as trajectories_api
from flywheel.trajectories.schemas import TrajectoryIn

ROUTERS = (
    meta_router,
    environments_api.router,
    evals_api.router,
    evals_api.calibration_router,
    online_eval_api.router,
    eval_runs_api.router,
    failures_api.router,
    clustering_api.router,
    registry_api.router,
    live_api.router,
    training_api.router,
    trajectories_api.router,
    trajectories_api.otlp_router,
)

for router in ROUTERS:
    api.add_router("", router)
# The request schema of POST /trajectories is written by hand (the body may be NDJSON): publish the
# TrajectoryIn model it points at.
api.add_component(TrajectoryIn)

urlpatterns = [path("", api.urls)]
