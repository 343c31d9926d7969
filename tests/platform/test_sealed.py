"""Secrets sealed at rest (flywheel.sealed): the webhook's signing secret and the judge's API key are written
to the database sealed and read back plain; a rotated SECRET_KEY opens them through SECRET_KEY_FALLBACKS and
`manage.py reseal` seals them again under the new key; a value no key opens fails closed (set, never used:
no webhook goes out unsigned, no judge is called without its key) and says why; values stored before sealing
are sealed by the migration's step and written back plain by its reverse."""

from __future__ import annotations

import logging
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from flywheel import sealed
from flywheel.evals.online_models import OnlineEvalSettings
from flywheel.registry.models import RegistrySettings, SyncState
from tests.standin import StandIn, serving

SECRET = "whsec-7f3a9c-not-for-anyone-else"


def stored(model, field: str, pk: int) -> str:
    """The column's value as the database holds it, past the field's opening."""
    table = connection.ops.quote_name(model._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {field} FROM {table} WHERE id = %s", [pk])
        return cursor.fetchone()[0]


def write_raw(model, field: str, pk: int, value: str) -> None:
    table = connection.ops.quote_name(model._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET {field} = %s WHERE id = %s", [value, pk])


def test_seal_and_unseal_round_trip_and_hide_the_secret():
    token = sealed.seal(SECRET)
    assert token.startswith(sealed.PREFIX) and SECRET not in token
    assert sealed.seal(SECRET) != token  # a fresh nonce each time: equal secrets do not look equal
    assert sealed.unseal(token) == SECRET
    assert sealed.seal(token) == token  # sealing twice changes nothing
    assert sealed.seal("") == "" and sealed.unseal("") == ""
    assert sealed.unseal("plain-from-before") == "plain-from-before"


@pytest.mark.parametrize(("model", "field"), [(RegistrySettings, "webhook_secret"),
                                              (OnlineEvalSettings, "judge_api_key")])
def test_the_database_holds_the_secret_sealed_and_the_model_reads_it_plain(project, model, field):
    row = model.objects.create(project=project, **{field: SECRET})
    raw = stored(model, field, row.pk)
    assert raw.startswith(sealed.PREFIX) and SECRET not in raw
    assert getattr(model.objects.get(pk=row.pk), field) == SECRET
    model.objects.filter(pk=row.pk).update(**{field: "second"})  # an update seals too
    assert stored(model, field, row.pk).startswith(sealed.PREFIX)
    assert getattr(model.objects.get(pk=row.pk), field) == "second"


OLD_KEY, NEW_KEY = "old-key-" + "x" * 40, "new-key-" + "y" * 40


def test_a_rotated_key_opens_through_the_fallbacks_and_an_unknown_one_is_set_but_refused(project, settings, caplog):
    settings.SECRET_KEY = OLD_KEY
    row = RegistrySettings.objects.create(project=project, webhook_secret=SECRET)
    token = stored(RegistrySettings, "webhook_secret", row.pk)

    settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = NEW_KEY, [OLD_KEY]
    assert RegistrySettings.objects.get(pk=row.pk).webhook_secret == SECRET

    settings.SECRET_KEY_FALLBACKS = []
    with caplog.at_level(logging.ERROR, logger="flywheel.sealed"):
        value = RegistrySettings.objects.get(pk=row.pk).webhook_secret
    assert "SECRET_KEY_FALLBACKS" in caplog.text and "webhook_secret" in caplog.text
    # Set, not empty (a page says so, a delivery fails), and never usable as the secret.
    assert value and isinstance(value, sealed.UnreadableSecret) and SECRET not in value
    with pytest.raises(sealed.Unreadable, match="SECRET_KEY_FALLBACKS"):
        sealed.readable(value)
    with pytest.raises(sealed.Unreadable):
        sealed.unseal(token)
    RegistrySettings.objects.get(pk=row.pk).save()  # saving the row back keeps what the old key can still open
    assert stored(RegistrySettings, "webhook_secret", row.pk) == token
    assert sealed.readable("") == "" and sealed.readable("plain") == "plain"


class _Receiver(StandIn):
    def do_POST(self):  # noqa: N802 (http.server's name)
        self.server.received.append((dict(self.headers), self.body()))
        self.answer(204)


def test_a_webhook_whose_secret_no_key_opens_fails_with_why_and_nothing_goes_out_unsigned(project, settings):
    from flywheel.registry import notify

    settings.SECRET_KEY = OLD_KEY
    with serving(_Receiver, received=[]) as hook:
        RegistrySettings.objects.create(project=project, webhook_url=hook.url + "/hook", webhook_secret=SECRET)
        settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = NEW_KEY, []  # rotated, the old key not kept
        row = notify.notify(project=project, event_type="watch.flagged", subject="v3 looks worse")
        assert notify.notification_deliver(notification_id=row.pk) == "failed"
        assert hook.received == []
    row.refresh_from_db()
    assert row.webhook_state == SyncState.FAILED and "SECRET_KEY_FALLBACKS" in row.last_error
    delivery = row.deliveries.get()
    assert delivery.error.startswith("not sent: the webhook secret was sealed under a SECRET_KEY")
    assert delivery.status_code is None


def test_reseal_seals_every_secret_under_the_current_key_and_names_what_no_key_opens(project, make_project, user,
                                                                                   settings):
    settings.SECRET_KEY = OLD_KEY
    old = RegistrySettings.objects.create(project=project, webhook_secret=SECRET)
    judge = OnlineEvalSettings.objects.create(project=project, judge_api_key="sk-judge")
    other = make_project("other-co", owner=user)
    plain = RegistrySettings.objects.create(project=other)
    write_raw(RegistrySettings, "webhook_secret", plain.pk, "from-before-sealing")
    before = stored(RegistrySettings, "webhook_secret", old.pk)

    settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = NEW_KEY, [OLD_KEY]
    out = StringIO()
    call_command("reseal", stdout=out)
    assert "registry_registrysettings.webhook_secret: 2 sealed" in out.getvalue()
    assert "evals_onlineevalsettings.judge_api_key: 1 sealed" in out.getvalue()
    assert stored(RegistrySettings, "webhook_secret", old.pk) != before
    assert stored(RegistrySettings, "webhook_secret", plain.pk).startswith(sealed.PREFIX)

    settings.SECRET_KEY_FALLBACKS = []  # the old key can go now
    assert RegistrySettings.objects.get(pk=old.pk).webhook_secret == SECRET
    assert RegistrySettings.objects.get(pk=plain.pk).webhook_secret == "from-before-sealing"
    assert OnlineEvalSettings.objects.get(pk=judge.pk).judge_api_key == "sk-judge"

    settings.SECRET_KEY = "third-key-" + "z" * 40  # rotated again, without the fallback: named, left as it is
    token = stored(RegistrySettings, "webhook_secret", old.pk)
    with pytest.raises(CommandError, match=rf"registry_registrysettings.webhook_secret id {old.pk}"):
        call_command("reseal", stdout=StringIO())
    assert stored(RegistrySettings, "webhook_secret", old.pk) == token


def test_the_migration_seals_what_was_stored_plain_and_its_reverse_writes_it_back(project):
    row = RegistrySettings.objects.create(project=project)
    write_raw(RegistrySettings, "webhook_secret", row.pk, SECRET)  # as a server before sealing wrote it
    assert RegistrySettings.objects.get(pk=row.pk).webhook_secret == SECRET  # read as it is meanwhile

    assert sealed.seal_stored(RegistrySettings, "webhook_secret") == 1
    assert stored(RegistrySettings, "webhook_secret", row.pk).startswith(sealed.PREFIX)
    assert RegistrySettings.objects.get(pk=row.pk).webhook_secret == SECRET

    sealed.unseal_stored(RegistrySettings, "webhook_secret", connection)
    assert stored(RegistrySettings, "webhook_secret", row.pk) == SECRET
