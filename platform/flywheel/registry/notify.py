"""Notifications: what a person should hear about without watching a page (a canary or a watched version
rolled back by rule, a version flagged worse, a failure mode that came back).

`notify` writes a `Notification` row in the caller's transaction and hands its delivery to a worker once that
commits: the project's signed webhook with the event type in `X-Flywheel-Event` (the body's `event` too), and
an e-mail through Django's mail backend to `RegistrySettings.notify_emails` where set. The row is the outbox:
a failed delivery is retried by the sweep with backoff, and the part already sent is not sent again."""

from __future__ import annotations

import json
import logging
from typing import Any

from django.conf import settings
from django.core.mail import send_mail
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from flywheel import outbound, outbox
from flywheel.accounts.models import Project
from flywheel.registry import services
from flywheel.registry.models import Notification, RegistrySettings, SyncState

logger = logging.getLogger(__name__)



def recipients(config: RegistrySettings | None) -> list[str]:
    if config is None:
        return []
    return [line.strip() for line in config.notify_emails.splitlines() if line.strip()]


def notify(*, project: Project, event_type: str, subject: str, text: str = "",
           payload: dict[str, Any] | None = None) -> Notification:
    """Record a notification and deliver it after the caller's transaction commits."""
    config = RegistrySettings.objects.filter(project=project).first()
    row = Notification.objects.create(
        project=project, event_type=event_type, subject=subject[:200], text=text, payload=payload or {},
        webhook_state=SyncState.PENDING if config and config.webhook_url else SyncState.DONE,
        email_state=SyncState.PENDING if recipients(config) else SyncState.DONE,
    )
    if row.webhook_state == SyncState.PENDING or row.email_state == SyncState.PENDING:
        from flywheel.registry.tasks import notification_deliver_task

        outbox.send_on_commit(notification_deliver_task, row.pk)
    return row


def body(row: Notification) -> bytes:
    return json.dumps({"event": row.event_type, "id": row.pk, "project": row.project.slug,
                       "subject": row.subject, "text": row.text, "at": row.at.isoformat(), **row.payload},
                      sort_keys=True, default=str).encode()


def _webhook(row: Notification, config: RegistrySettings) -> None:
    services.webhook_deliver(config=config, event_type=row.event_type, delivery=f"n{row.pk}", body=body(row),
                             notification=row)


def notification_deliver(*, notification_id: int) -> str:
    """Send what is still pending of one notification. Safe to run twice: the row is held while it is sent."""
    with transaction.atomic():
        row = (Notification.objects.select_for_update(skip_locked=True, of=("self",)).select_related("project")
               .filter(pk=notification_id).first())
        if row is None:
            return "gone or busy"
        config = RegistrySettings.objects.filter(project=row.project).first()
        errors = []
        if row.webhook_state != SyncState.DONE:
            try:
                if config is None or not config.webhook_url:
                    raise RuntimeError("no webhook is set any more")
                _webhook(row, config)
                row.webhook_state = SyncState.DONE
            except Exception as exc:  # noqa: BLE001
                row.webhook_state = SyncState.FAILED
                errors.append(str(exc))
        if row.email_state != SyncState.DONE:
            try:
                to = recipients(config)
                if not to:
                    raise RuntimeError("no address to mail any more")
                send_mail(f"[Flywheel {row.project.slug}] {row.subject}", row.text or row.subject,
                          settings.DEFAULT_FROM_EMAIL, to)
                row.email_state = SyncState.DONE
            except Exception as exc:  # noqa: BLE001
                row.email_state = SyncState.FAILED
                errors.append(f"e-mail: {exc}")
        if errors:
            row.attempts += 1
            row.last_error = outbound.redact("; ".join(errors))[:2000]
            row.next_attempt_at = timezone.now() + services.backoff(row.attempts)
        row.save(update_fields=["webhook_state", "email_state", "attempts", "last_error", "next_attempt_at"])
    return "failed" if errors else "sent"


def notification_sweep() -> int:
    """The outbox sweep: notifications whose retry time has come, or that waited too long for a worker."""
    from flywheel.registry.tasks import notification_deliver_task

    now = timezone.now()
    failed = Q(webhook_state=SyncState.FAILED) | Q(email_state=SyncState.FAILED)
    pending = Q(webhook_state=SyncState.PENDING) | Q(email_state=SyncState.PENDING)
    due = Notification.objects.filter((failed & Q(next_attempt_at__lte=now))
                                      | (pending & Q(at__lte=now - outbox.requeue_after())))
    sent = 0
    for pk in due.values_list("id", flat=True)[:100]:
        try:
            outbox.send(notification_deliver_task, pk)
        except outbox.BrokerUnavailable:
            break
        sent += 1
    return sent
