from django.apps import AppConfig


class TrainingConfig(AppConfig):
    name = "flywheel.training"
    label = "training"
    default_auto_field = "django.db.models.BigAutoField"
