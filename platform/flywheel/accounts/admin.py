from django.contrib import admin

from flywheel.accounts.models import ApiKey, Membership, Project


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "created_at")


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ("project", "user", "role")


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("project", "name", "prefix", "scopes", "created_at", "revoked_at")
    readonly_fields = ("digest", "prefix")
