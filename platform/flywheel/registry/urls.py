"""The Models page and its actions, under /p/<project_slug>/models/."""

from django.urls import path

from flywheel.registry import canary_views, live_views, views

urlpatterns = [
    path("models/", views.registry_page, name="registry_page"),
    path("models/base", views.base_model_register, name="registry_base_register"),
    path("models/v<int:version_number>/promote", views.version_promote, name="registry_version_promote"),
    path("models/rollback", views.production_rollback, name="registry_rollback"),
    path("models/gate/<int:decision_id>/", views.gate_decision_page, name="registry_gate"),
    path("models/gate-rules", views.gate_rules_save, name="registry_gate_rules"),
    path("models/settings", views.registry_settings_save, name="registry_settings_save"),
    path("models/v<int:version_number>/canary", canary_views.version_canary, name="registry_version_canary"),
    path("models/canary/promote", canary_views.canary_promote, name="registry_canary_promote"),
    path("models/canary/rollback", canary_views.canary_rollback, name="registry_canary_rollback"),
    path("models/live-rules", canary_views.live_rules_save, name="registry_live_rules"),
    path("models/checks/<int:check_id>/", canary_views.live_check_page, name="registry_live_check"),
    path("models/v<int:version_number>/", live_views.version_page, name="registry_version"),
    path("models/v<int:version_number>/price", live_views.version_price_set, name="registry_version_price"),
    path("models/names", live_views.version_name_set, name="registry_version_name_set"),
    path("models/names/remove", live_views.version_name_remove, name="registry_version_name_remove"),
]
