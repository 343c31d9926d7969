"""The environment-server registration form: the fields and their help; the checks are the service's
(`environment_server_register`), so the page and any other door refuse the same URLs."""

from __future__ import annotations

from django import forms


class EnvironmentServerForm(forms.Form):
    name = forms.CharField(max_length=120, help_text="How the task sets and jobs pages name it.")
    url = forms.CharField(
        max_length=500, label="URL",
        help_text="The server's base URL: it answers POST {url}/reset, /step and /verify "
                  "(the trainer's http environment). Only URLs the operator lists in "
                  "FLYWHEEL_ENV_URL_ALLOWLIST can be registered.",
    )
    description = forms.CharField(required=False, widget=forms.TextInput)


class ServerTaskSetForm(forms.Form):
    name = forms.CharField(max_length=120)
