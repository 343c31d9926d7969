"""The Models page and its actions, under /p/<project_slug>/models/, and the flywheel dashboard."""

from django.urls import path

from flywheel.registry import views

urlpatterns = [
    path("models/", views.registry_page, name="registry_page"),
    path("models/base", views.base_model_register, name="registry_base_register"),
    path("models/v<int:version_number>/promote", views.version_promote, name="registry_version_promote"),
    path("models/rollback", views.production_rollback, name="registry_rollback"),
    path("models/gate/<int:decision_id>/", views.gate_decision_page, name="registry_gate"),
    path("models/gate-rules", views.gate_rules_save, name="registry_gate_rules"),
    path("models/settings", views.registry_settings_save, name="registry_settings_save"),
    path("dashboard/", views.dashboard_page, name="flywheel_dashboard"),
]
