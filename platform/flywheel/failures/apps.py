from django.apps import AppConfig


class FailuresConfig(AppConfig):
    name = "flywheel.failures"
    label = "failures"
    verbose_name = "Failure modes"
