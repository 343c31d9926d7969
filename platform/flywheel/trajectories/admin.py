from django.contrib import admin

from flywheel.trajectories.models import Comment, Tag, Trajectory


@admin.register(Trajectory)
class TrajectoryAdmin(admin.ModelAdmin):
    list_display = ("project", "external_id", "agent", "model_version", "outcome", "created_at")
    list_filter = ("outcome",)
    search_fields = ("external_id",)


admin.site.register(Tag)
admin.site.register(Comment)
