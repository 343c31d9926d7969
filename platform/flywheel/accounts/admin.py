from django.contrib import admin

from flywheel.accounts.models import ApiKey, Membership, Project, WorkerHeartbeat


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


@admin.register(WorkerHeartbeat)
class WorkerHeartbeatAdmin(admin.ModelAdmin):
    """Workers as they last reported; delete a host taken away for good, whose GPUs jobs may still ask for."""

    list_display = ("hostname", "seen_at", "queues", "gpus", "tasks_seen")
