"""Secrets sealed at rest (flywheel.sealed): the webhook's signing secret and the judge's API key are written
to the database sealed and read back plain; a rotated SECRET_KEY opens them through SECRET_KEY_FALLBACKS; a
value no key opens reads as unset and says why in the log; values stored before sealing are sealed by the
migration's step and written back plain by its reverse."""

from __future__ import annotations

import logging

import pytest
from django.db import connection

from flywheel import sealed
from flywheel.evals.online_models import OnlineEvalSettings
from flywheel.registry.models import RegistrySettings

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


def test_a_rotated_key_opens_through_the_fallbacks_and_an_unknown_one_reads_as_unset(project, settings, caplog):
    settings.SECRET_KEY = "old-key-" + "x" * 40
    row = RegistrySettings.objects.create(project=project, webhook_secret=SECRET)

    settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = "new-key-" + "y" * 40, ["old-key-" + "x" * 40]
    assert RegistrySettings.objects.get(pk=row.pk).webhook_secret == SECRET

    settings.SECRET_KEY_FALLBACKS = []
    with caplog.at_level(logging.ERROR, logger="flywheel.sealed"):
        assert RegistrySettings.objects.get(pk=row.pk).webhook_secret == ""
    assert "SECRET_KEY_FALLBACKS" in caplog.text and "webhook_secret" in caplog.text
    with pytest.raises(sealed.Unreadable):
        sealed.unseal(stored(RegistrySettings, "webhook_secret", row.pk))


def test_the_migration_seals_what_was_stored_plain_and_its_reverse_writes_it_back(project):
    row = RegistrySettings.objects.create(project=project)
    write_raw(RegistrySettings, "webhook_secret", row.pk, SECRET)  # as a server before sealing wrote it
    assert RegistrySettings.objects.get(pk=row.pk).webhook_secret == SECRET  # read as it is meanwhile

    assert sealed.seal_stored(RegistrySettings, "webhook_secret") == 1
    assert stored(RegistrySettings, "webhook_secret", row.pk).startswith(sealed.PREFIX)
    assert RegistrySettings.objects.get(pk=row.pk).webhook_secret == SECRET

    sealed.unseal_stored(RegistrySettings, "webhook_secret", connection)
    assert stored(RegistrySettings, "webhook_secret", row.pk) == SECRET
