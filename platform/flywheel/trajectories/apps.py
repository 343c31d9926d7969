from django.apps import AppConfig


class TrajectoriesConfig(AppConfig):
    name = "flywheel.trajectories"
    label = "trajectories"
    verbose_name = "Trajectories"
