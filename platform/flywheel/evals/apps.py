from django.apps import AppConfig


class EvalsConfig(AppConfig):
    name = "flywheel.evals"
    label = "evals"
    verbose_name = "Eval suites"

    def ready(self) -> None:
        # A trajectory online evaluation scored below its project's threshold goes to the review queue; the
        # failures app sits below this one, so this app registers the reason there.
        from flywheel.evals.online import low_score
        from flywheel.failures.queue import queue_reason_register

        queue_reason_register(low_score)

        # Online scores join a version's live metrics (the registry sits below and cannot ask).
        from flywheel.evals.online import live_source
        from flywheel.registry.live import metric_source_register

        metric_source_register(live_source)

        # Failure modes a promotion fixes, and the production version the failures app asks for when a person
        # marks a mode fixed: the apps below cannot import this one, so it listens.
        from flywheel.evals import recurrence
        from flywheel.failures.recurrence import production_version_asked
        from flywheel.registry.signals import production_moved

        production_version_asked.connect(recurrence.answer_production, dispatch_uid="flywheel.evals.recurrence")
        production_moved.connect(recurrence.after_production_move, dispatch_uid="flywheel.evals.recurrence")
