from django.apps import AppConfig


class RegistryConfig(AppConfig):
    name = "flywheel.registry"
    label = "registry"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Ingestion checks that an evidence token names the version a trajectory's model_version names; the
        # trajectories app sits below this one, so this app registers how names map to versions.
        from flywheel.registry.evidence import version_numbers
        from flywheel.trajectories.vouch import version_resolver_set

        version_resolver_set(version_numbers)
