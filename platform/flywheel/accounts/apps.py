from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "flywheel.accounts"
    label = "accounts"
    verbose_name = "Projects and access"
