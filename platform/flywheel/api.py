"""The NinjaAPI instance. Routers are added by the apps that own them."""

from ninja import NinjaAPI

api = NinjaAPI(title="Flywheel API", version="1", urls_namespace="api")

# Routers register themselves on import; importing them here loads them with the URLconf.
from flywheel.trajectories import api as _trajectories_api  # noqa: E402, F401
