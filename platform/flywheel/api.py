"""The NinjaAPI instance. Routers are added by the apps that own them."""

from ninja import NinjaAPI

api = NinjaAPI(title="Flywheel API", version="1", urls_namespace="api")

# Routers register themselves on import; importing them here loads them with the URLconf.
from flywheel.environments import api as _environments_api  # noqa: E402, F401
from flywheel.evals import api as _evals_api  # noqa: E402, F401
from flywheel.evals import run_api as _eval_runs_api  # noqa: E402, F401
from flywheel.failures import api as _failures_api  # noqa: E402, F401
from flywheel.failures.clustering import api as _clustering_api  # noqa: E402, F401
from flywheel.registry import api as _registry_api  # noqa: E402, F401
from flywheel.training import api as _training_api  # noqa: E402, F401
from flywheel.trajectories import api as _trajectories_api  # noqa: E402, F401
