"""The MLflow side of the registry: one registered model per project, its versions and aliases.

Every call here is idempotent, so the sync task can simply be run again after a failure: a version is found
by its `flywheel_version` tag before one is created, and setting an alias to where it already points is a
no-op."""

from __future__ import annotations

import threading
from functools import lru_cache

from django.conf import settings

from flywheel.registry.models import ModelVersion


@lru_cache(maxsize=4)
def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def client():
    return _client(settings.MLFLOW_TRACKING_URI)


def preload_client() -> threading.Thread:
    """Make `client` in a daemon thread (a web process at its start): importing MLflow and opening its store
    costs seconds, which the first Promote or rollback would otherwise spend in a person's request."""
    thread = threading.Thread(target=client, name="flywheel-mlflow-client", daemon=True)
    thread.start()
    return thread


def registered_model_name(project_slug: str) -> str:
    return f"flywheel-{project_slug}"


def _ensure_registered_model(name: str) -> None:
    from mlflow.exceptions import MlflowException

    mlflow = client()
    try:
        mlflow.get_registered_model(name)
    except MlflowException:
        try:
            mlflow.create_registered_model(name, description="Model versions of a Flywheel project.")
        except MlflowException:
            mlflow.get_registered_model(name)  # created meanwhile by another worker: fine


def version_register(version: ModelVersion) -> str:
    """The MLflow version number of `version`, registering it first when MLflow does not have it."""
    name = registered_model_name(version.project.slug)
    _ensure_registered_model(name)
    mlflow = client()
    found = mlflow.search_model_versions(f"name = '{name}' and tag.flywheel_version = '{version.number}'")
    if found:
        return str(found[0].version)
    created = mlflow.create_model_version(
        name,
        source=version.adapter_path or version.base.path,
        tags={
            "flywheel_version": str(version.number),
            "base_model": version.base.name,
            "base_path": version.base.path,
            "adapter_sha256": version.adapter_sha256,
        },
        description=version.description or None,
    )
    return str(created.version)


def alias_set(*, project_slug: str, alias: str, mlflow_version: str) -> None:
    client().set_registered_model_alias(registered_model_name(project_slug), alias, mlflow_version)


def alias_get(*, project_slug: str, alias: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return str(client().get_model_version_by_alias(registered_model_name(project_slug), alias).version)
    except MlflowException:
        return None


def alias_delete(*, project_slug: str, alias: str) -> None:
    """Remove `alias` (a canary that ended); nothing to do when MLflow has no such alias or model."""
    from mlflow.exceptions import MlflowException

    if alias_get(project_slug=project_slug, alias=alias) is None:
        return
    try:
        client().delete_registered_model_alias(registered_model_name(project_slug), alias)
    except MlflowException:
        if alias_get(project_slug=project_slug, alias=alias) is not None:
            raise
