"""API of the registry: what serves now, for a serving stack that follows `production`."""

from __future__ import annotations

from datetime import datetime

from django.http import HttpRequest
from ninja import Router, Schema
from ninja.errors import HttpError

from flywheel.api import api
from flywheel.registry import selectors
from flywheel.trajectories.api import ErrorOut, read_auth

router = Router(tags=["models"])


class ProductionOut(Schema):
    project: str
    version: int
    base_model: str
    base_model_path: str
    adapter_path: str | None
    adapter_sha256: str | None
    mlflow_registered_model: str
    mlflow_version: str | None
    since: datetime | None
    reason: str


@router.get(
    "/models/production",
    auth=read_auth,
    response={200: ProductionOut, 401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 429: ErrorOut, 503: ErrorOut},
    summary="The production model",
    description=(
        "The model version the `production` alias points at in the key's project: its base model's path, its "
        "adapter's location and content hash (SHA-256 over the adapter folder's files), so a serving stack "
        "can load it and check what it loaded. 404 while no model is registered."
    ),
)
def production_get(request: HttpRequest) -> dict:
    from flywheel.registry.mlflow_bridge import registered_model_name

    project = request.auth.project
    version = selectors.production_of(project=project)
    if version is None:
        raise HttpError(404, "No model is in production in this project yet.")
    since = selectors.alias_since(project=project)
    return {
        "project": project.slug,
        "version": version.number,
        "base_model": version.base.name,
        "base_model_path": version.base.path,
        "adapter_path": version.adapter_path or None,
        "adapter_sha256": version.adapter_sha256 or None,
        "mlflow_registered_model": registered_model_name(project.slug),
        "mlflow_version": version.mlflow_version or None,
        "since": since.at if since else None,
        "reason": since.reason if since else "",
    }


api.add_router("", router)
