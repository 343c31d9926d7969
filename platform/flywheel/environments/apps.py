from django.apps import AppConfig


class EnvironmentsConfig(AppConfig):
    name = "flywheel.environments"
    label = "environments"
    verbose_name = "Environment tasks"
