from django.apps import AppConfig


class EnvironmentsConfig(AppConfig):
    name = "flywheel.environments"
    label = "environments"
    verbose_name = "Environment tasks"

    def ready(self) -> None:
        # Episodes the platform scores in its own process (promotion, calibration) run the trainer's
        # environments, whose requests must obey the operator's settings, not the process environment.
        from django.core.exceptions import ImproperlyConfigured

        from flywheel.outbound import policy
        from trainer.outbound import set_policy_source

        try:
            policy()  # a malformed FLYWHEEL_OUTBOUND_ALLOWLIST entry stops the start, naming the entry
        except ValueError as exc:
            raise ImproperlyConfigured(str(exc)) from None
        set_policy_source(policy)

        # Task sets are the train side of the eval app's row machinery, which does not import this app.
        from flywheel.environments.models import EnvironmentServer, Task, TaskSet, TaskSetVersion
        from flywheel.environments.services import task_set_create
        from flywheel.evals.kinds import TrainSide, train_side_register

        train_side_register(TrainSide(collection=TaskSet, item=Task, version=TaskSetVersion, server=EnvironmentServer,
                                      create=task_set_create))
