from django.apps import AppConfig


class SeedConfig(AppConfig):
    name = "flywheel.seed"
    label = "seed"
