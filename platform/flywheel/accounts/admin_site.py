"""The Django admin, for superusers only.

Project roles live in memberships, which the admin knows nothing of: a staff user with model permissions
would read the trajectories of every project. So /admin/ lets in superusers alone (who may do anything
anyway), and the per-project pages stay the only way members see their projects. Wired the Django way:
`flywheel.accounts.apps.SuperuserAdminConfig` replaces "django.contrib.admin" in INSTALLED_APPS and names
this site class as the default site, on which every `admin.register` lands."""

from __future__ import annotations

from django.contrib.admin import AdminSite
from django.contrib.admin.forms import AdminAuthenticationForm
from django.core.exceptions import ValidationError
from django.http import HttpRequest


class SuperuserAuthenticationForm(AdminAuthenticationForm):
    """The admin's login form, refusing anyone but an active superuser (staff alone is not enough)."""

    error_messages = {
        **AdminAuthenticationForm.error_messages,
        "invalid_login": (
            "Please enter the correct %(username)s and password for a superuser account. Note that both "
            "fields may be case-sensitive."
        ),
    }

    def confirm_login_allowed(self, user) -> None:
        super().confirm_login_allowed(user)
        if not user.is_superuser:
            raise ValidationError(
                self.error_messages["invalid_login"],
                code="invalid_login",
                params={"username": self.username_field.verbose_name},
            )


class SuperuserAdminSite(AdminSite):
    site_header = "Flywheel administration"
    site_title = "Flywheel admin"
    login_form = SuperuserAuthenticationForm

    def has_permission(self, request: HttpRequest) -> bool:
        # Every admin view but login and logout goes through this check (AdminSite.admin_view).
        return request.user.is_active and request.user.is_superuser
