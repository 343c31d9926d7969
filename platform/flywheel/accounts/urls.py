"""Login, the project list at /, and a project's settings under /p/<project_slug>/settings/."""

from django.contrib.auth import views as auth_views
from django.urls import path

from flywheel.accounts import views

urlpatterns = [
    path("accounts/login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", views.project_list, name="project_list"),
    path("p/<slug:project_slug>/settings/", views.project_settings, name="project_settings"),
    path("p/<slug:project_slug>/settings/members/", views.member_add, name="member_add"),
    path("p/<slug:project_slug>/settings/members/<int:user_id>/", views.member_update, name="member_update"),
    path("p/<slug:project_slug>/settings/members/<int:user_id>/remove/", views.member_remove, name="member_remove"),
    path("p/<slug:project_slug>/settings/keys/", views.api_key_create, name="api_key_create"),
    path("p/<slug:project_slug>/settings/keys/<int:key_id>/revoke/", views.api_key_revoke, name="api_key_revoke"),
]
