"""Notifications: a signed webhook with the event type and an e-mail, each sent once, retried until sent."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core import mail
from django.utils import timezone

from flywheel.registry import notify
from flywheel.registry.models import Notification, RegistrySettings, SyncState

pytestmark = pytest.mark.django_db


class _Hook(BaseHTTPRequestHandler):
    received: list[tuple[dict, bytes]] = []
    status = 204

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Hook.received.append((dict(self.headers), body))
        self.send_response(_Hook.status)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def hook():
    _Hook.received, _Hook.status = [], 204
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    server.shutdown()


def test_a_notification_is_signed_typed_mailed_and_sent_once(project, hook):
    RegistrySettings.objects.create(project=project, webhook_url=hook, webhook_secret="s3cret",
                                    notify_emails="ops@example.com\n\n lead@example.com ")
    row = notify.notify(project=project, event_type="watch.rolled_back", subject="v3 rolled back by the watch",
                        text="failure rate 31% against 20%", payload={"version": 3, "to_version": 2})
    notify.notification_deliver(notification_id=row.pk)
    headers, body = _Hook.received[0]
    assert headers["X-Flywheel-Event"] == "watch.rolled_back"
    expected = "sha256=" + hmac.new(b"s3cret", headers["X-Flywheel-Timestamp"].encode() + b"." + body,
                                    hashlib.sha256).hexdigest()
    assert headers["X-Flywheel-Signature"] == expected
    data = json.loads(body)
    assert data["event"] == "watch.rolled_back" and data["version"] == 3 and data["project"] == project.slug
    assert len(mail.outbox) == 1 and mail.outbox[0].to == ["ops@example.com", "lead@example.com"]
    assert "rolled back by the watch" in mail.outbox[0].subject
    row.refresh_from_db()
    assert (row.webhook_state, row.email_state) == (SyncState.DONE, SyncState.DONE)
    notify.notification_deliver(notification_id=row.pk)
    assert len(_Hook.received) == 1 and len(mail.outbox) == 1  # nothing sent twice


def test_a_failed_webhook_is_retried_and_the_mail_already_sent_is_not_sent_again(project, hook):
    RegistrySettings.objects.create(project=project, webhook_url=hook, notify_emails="ops@example.com")
    _Hook.status = 500
    row = notify.notify(project=project, event_type="mode.reopened", subject="Mode came back")
    assert notify.notification_deliver(notification_id=row.pk) == "failed"
    row.refresh_from_db()
    assert row.webhook_state == SyncState.FAILED and row.email_state == SyncState.DONE
    assert row.next_attempt_at > timezone.now() and "HTTP 500" in row.last_error
    assert [d.status_code for d in row.deliveries.all()] == [500]
    _Hook.status = 204
    Notification.objects.filter(pk=row.pk).update(next_attempt_at=timezone.now())
    assert notify.notification_deliver(notification_id=row.pk) == "sent"
    assert len(mail.outbox) == 1 and len(_Hook.received) == 2


def test_without_a_webhook_or_addresses_nothing_waits(project):
    row = notify.notify(project=project, event_type="canary.worse", subject="x")
    assert (row.webhook_state, row.email_state) == (SyncState.DONE, SyncState.DONE)
    assert notify.notification_sweep() == 0


def test_the_sweep_hands_due_notifications_to_a_worker(project, hook, celery_worker):
    RegistrySettings.objects.create(project=project, webhook_url=hook)
    row = Notification.objects.create(project=project, event_type="canary.worse", subject="x",
                                      webhook_state=SyncState.FAILED, email_state=SyncState.DONE,
                                      next_attempt_at=timezone.now())
    assert notify.notification_sweep() == 1
    celery_worker.wait_for(lambda: Notification.objects.get(pk=row.pk).webhook_state == SyncState.DONE)
    assert len(_Hook.received) == 1
