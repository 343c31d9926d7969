"""The NinjaAPI instance. Routers are added by the apps that own them."""

from ninja import NinjaAPI

api = NinjaAPI(title="Flywheel API", version="1", urls_namespace="api")
