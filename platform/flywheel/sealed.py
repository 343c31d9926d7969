"""Secrets the platform must use again but must not keep readable (a webhook's signing secret, an LLM judge's
API key): sealed with a key derived from SECRET_KEY before they are written, opened when read, so a copy of the
database alone (a backup, a replica, a dump) does not give them away.

Fernet (the `cryptography` library's authenticated encryption) under a key derived by HKDF from SECRET_KEY; the
keys of SECRET_KEY_FALLBACKS open what they sealed. Rotating SECRET_KEY: move the old key to
SECRET_KEY_FALLBACKS, run `manage.py reseal` (every secret sealed again under the new key, `reseal_stored`),
then drop the old key. A value written before sealing existed is read as it is and sealed when next saved
(the migrations that introduce the field seal the stored ones).

A sealed value no key opens fails closed: it reads as `UnreadableSecret` (set, not empty), and `readable`
refuses it, so a webhook is not sent unsigned nor a judge called without its key as if none were set."""

from __future__ import annotations

import base64
import functools
import logging
from dataclasses import dataclass, field
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings
from django.db import models

logger = logging.getLogger(__name__)

PREFIX = "sealed:v1:"


class Unreadable(Exception):
    """A sealed value that none of this server's keys opens: it was sealed under another SECRET_KEY."""


UNREADABLE = ("was sealed under a SECRET_KEY this server does not have: put the old key in SECRET_KEY_FALLBACKS "
              "(then run manage.py reseal), or set the secret again")


class UnreadableSecret(str):
    """What a SealedField reads when no key of this server opens its value: the sealed text as stored (so a
    save writes it back unchanged), true like any set secret, and never the secret itself: `readable`
    refuses it. `problem` says why, for the pages."""

    problem = UNREADABLE


def readable(value: str) -> str:
    """The secret to use from a SealedField's value: "" when none is set, else the secret; Unreadable when it
    is set but no key of this server opens it (the caller fails, naming why, rather than going on without)."""
    if isinstance(value, UnreadableSecret):
        raise Unreadable(UNREADABLE)
    return value


def _key(secret: str) -> bytes:
    # A key of its own for this purpose, so that nothing else derived from SECRET_KEY (sessions, signing) shares it.
    derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"flywheel.sealed", info=b"v1").derive(secret.encode())
    return base64.urlsafe_b64encode(derived)


@functools.lru_cache(maxsize=4)
def _fernet_of(secrets: tuple[str, ...]) -> MultiFernet:
    return MultiFernet([Fernet(_key(s)) for s in secrets])


def _fernet() -> MultiFernet:
    # Derived once per set of keys, not on every settings row read; keyed by the keys, so a change of them
    # (a rotation, a test's settings) derives again.
    return _fernet_of((settings.SECRET_KEY, *getattr(settings, "SECRET_KEY_FALLBACKS", [])))


def is_sealed(value: str) -> bool:
    return value.startswith(PREFIX)


def seal(plain: str) -> str:
    """`plain` sealed under SECRET_KEY; "" stays "" (no secret set) and a sealed value is left as it is."""
    if not plain or is_sealed(plain):
        return plain
    return PREFIX + _fernet().encrypt(plain.encode()).decode()


def unseal(stored: str) -> str:
    """The secret `stored` holds: opened when sealed (Unreadable when no key of this server opens it), else the
    value as it was written before sealing existed."""
    if not is_sealed(stored):
        return stored
    try:
        return _fernet().decrypt(stored[len(PREFIX):].encode()).decode()
    except InvalidToken:
        raise Unreadable(UNREADABLE) from None


class SealedField(models.TextField):
    """A text column whose value is sealed in the database and plain in Python. A value this server cannot open
    reads as an `UnreadableSecret` (set, but refused by `readable`), with an error in the log saying why."""

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        if value is None:
            return value
        try:
            return unseal(value)
        except Unreadable as exc:
            logger.error("%s.%s: %s", self.model._meta.db_table, self.column, exc)
            return UnreadableSecret(value)

    def get_prep_value(self, value: Any) -> Any:
        value = super().get_prep_value(value)
        return seal(value) if isinstance(value, str) else value


def seal_stored(model: type[models.Model], field: str) -> int:
    """Seal the values of `model.field` written before sealing existed (a data migration's forward step);
    returns how many. Reading passes a plain value through, and writing it back seals it."""
    sealed = 0
    for pk, value in model.objects.exclude(**{field: ""}).values_list("pk", field):
        sealed += model.objects.filter(pk=pk).update(**{field: value})
    return sealed


def unseal_stored(model: type[models.Model], field: str, connection: Any) -> None:
    """Write `model.field`'s values back in plain (a data migration's backward step, before the column becomes
    a plain one again), past the field's own sealing."""
    table, column = (connection.ops.quote_name(n) for n in (model._meta.db_table, model._meta.get_field(field).column))
    with connection.cursor() as cursor:
        for pk, value in model.objects.exclude(**{field: ""}).values_list("pk", field):
            cursor.execute(f"UPDATE {table} SET {column} = %s WHERE id = %s", [value, pk])


@dataclass
class Resealed:
    """What `reseal_stored` did: secrets sealed again under the current key, per "table.column", and the rows
    whose secret no key opens (left as they are)."""

    resealed: dict[str, int] = field(default_factory=dict)
    unreadable: list[str] = field(default_factory=list)


def sealed_fields() -> list[tuple[type[models.Model], SealedField]]:
    """Every SealedField of every installed model."""
    from django.apps import apps

    return [(model, f) for model in apps.get_models() for f in model._meta.concrete_fields
            if isinstance(f, SealedField)]


def reseal_stored(connection: Any) -> Resealed:
    """Seal every stored secret again under the current SECRET_KEY (`MultiFernet.rotate`: opened by whichever
    key of SECRET_KEY and SECRET_KEY_FALLBACKS sealed it), and seal the ones stored plain; after it, the old
    keys can leave SECRET_KEY_FALLBACKS. A value no key opens is left as it is and reported."""
    report = Resealed()
    fernet = _fernet()
    for model, f in sealed_fields():
        label = f"{model._meta.db_table}.{f.column}"
        table, column = connection.ops.quote_name(model._meta.db_table), connection.ops.quote_name(f.column)
        with connection.cursor() as cursor:  # the stored text, past the field's opening
            cursor.execute(f"SELECT id, {column} FROM {table} WHERE {column} <> ''")
            rows = cursor.fetchall()
        done = 0
        for pk, stored in rows:
            if is_sealed(stored):
                try:
                    value = PREFIX + fernet.rotate(stored[len(PREFIX):].encode()).decode()
                except InvalidToken:
                    report.unreadable.append(f"{label} id {pk}")
                    continue
            else:
                value = seal(stored)
            with connection.cursor() as cursor:
                cursor.execute(f"UPDATE {table} SET {column} = %s WHERE id = %s", [value, pk])
            done += 1
        report.resealed[label] = done
    return report
