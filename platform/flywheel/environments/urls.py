"""Task-set pages under /p/<project_slug>/: the same views as eval suites (flywheel.evals.views), plus
synthetic variants of a task and the environment servers."""

from django.urls import path

from flywheel.environments import views as env_views
from flywheel.evals import views


def task_set(view):  # noqa: ANN001, ANN201 - a URLconf helper
    return views.for_kind(view, "taskset")


urlpatterns = [
    path("tasks/", task_set(views.collection_list), name="taskset_list"),
    path("tasks/new", task_set(views.collection_create), name="taskset_create"),
    path("tasks/<int:task_set_id>/", task_set(views.collection_detail), name="taskset_detail"),
    path("tasks/<int:task_set_id>/tasks/<int:task_id>/remove", task_set(views.item_remove), name="taskset_item_remove"),
    path("tasks/<int:task_set_id>/tasks/<int:task_id>/variants", env_views.task_variants, name="task_variants"),
    path("tasks/<int:task_set_id>/v/<int:number>/", task_set(views.version_detail), name="taskset_version"),
    path("tasks/<int:task_set_id>/v/<int:number>.jsonl", task_set(views.version_export), name="taskset_export"),
    path("tasks/<int:task_set_id>/v/<int:number>/freeze", task_set(views.version_freeze), name="taskset_freeze"),
    path("environments/", env_views.environment_servers, name="environment_servers"),
    path("environments/register", env_views.environment_server_register, name="environment_server_register"),
    path("environments/<int:server_id>/check", env_views.environment_server_recheck, name="environment_server_recheck"),
    path("environments/<int:server_id>/task-sets", env_views.environment_server_task_set,
         name="environment_server_task_set"),
]
