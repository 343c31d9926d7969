from django.apps import AppConfig


class ClusteringConfig(AppConfig):
    name = "flywheel.failures.clustering"
    label = "clustering"
    verbose_name = "Clustering suggestions"
