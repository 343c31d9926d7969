from django.apps import AppConfig


class EvalsConfig(AppConfig):
    name = "flywheel.evals"
    label = "evals"
    verbose_name = "Eval suites"
