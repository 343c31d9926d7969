"""Forms of the accounts pages: they check input; the services decide."""

from __future__ import annotations

from django import forms

from flywheel.accounts.models import Role, Scope


class MemberAddForm(forms.Form):
    username = forms.CharField(max_length=150)
    role = forms.ChoiceField(choices=Role.choices, initial=Role.VIEWER)


class MemberRoleForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices)


class ApiKeyCreateForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="Where the key is used, e.g. production agent.")
    scopes = forms.MultipleChoiceField(
        choices=Scope.choices,
        widget=forms.CheckboxSelectMultiple,
        initial=[Scope.INGEST],
        error_messages={"required": "Choose at least one scope."},
    )
