from django.apps import AppConfig
from django.contrib.admin import apps as admin_apps


class AccountsConfig(AppConfig):
    name = "flywheel.accounts"
    label = "accounts"
    verbose_name = "Projects and access"


class SuperuserAdminConfig(admin_apps.AdminConfig):
    """django.contrib.admin with its default site for superusers only (see `admin_site`). Named in
    INSTALLED_APPS in place of "django.contrib.admin"; `default = False` keeps AccountsConfig the config
    that "flywheel.accounts" picks."""

    default = False
    default_site = "flywheel.accounts.admin_site.SuperuserAdminSite"
