from django.apps import AppConfig


class FailuresConfig(AppConfig):
    name = "flywheel.failures"
    label = "failures"
    verbose_name = "Failure modes"

    def ready(self) -> None:
        from flywheel.accounts.signals import project_created

        project_created.connect(_seed_taxonomy, dispatch_uid="flywheel.failures.taxonomy_seed")


def _seed_taxonomy(sender, *, project, **kwargs) -> None:
    """Every new project starts with the field's failure categories (`services.taxonomy_seed`)."""
    from flywheel.failures.services import taxonomy_seed  # models are not loaded when this module is

    taxonomy_seed(project=project)
