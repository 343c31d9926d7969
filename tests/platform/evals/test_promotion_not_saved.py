"""Saving a promotion that the checks refuse says "Not saved" with the reason, and the form keeps what the
reviewer typed (also a field that does not parse), so nothing is lost to a correction."""

from __future__ import annotations

import html as html_lib
import json

import pytest
from django.urls import reverse

pytestmark = pytest.mark.django_db

WRONG_REFERENCE = '[{"name": "refund", "arguments": {"order_id": "A-1001", "amount": 70}}]'


def _save(client, url, corrected, suite, **extra):
    data = {"target": f"suite:{suite.pk}", "action": "save", "message_index": corrected["message_index"],
            "expect": corrected["expect"], "expected_calls": json.dumps(corrected["expected_calls"]),
            "answer_match": "exact", "env_type": "single_turn", **extra}
    return client.post(url, data)


def _textarea(html: str, field_id: str) -> str:
    return html_lib.unescape(html.split(f'id="{field_id}"')[1].split(">", 1)[1].split("</textarea>")[0])


def test_a_failing_reference_is_not_saved_and_says_why(client_for, user, project, trajectory, suite, corrected):
    client = client_for(user)
    url = reverse("promotion_form", args=[project.slug, trajectory.pk])
    response = _save(client, url, corrected, suite, reference_calls=WRONG_REFERENCE)
    html = response.content.decode()
    assert response.status_code == 422
    banner = html.split('id="not-saved"')[1].split("</div>")[0]
    assert "Not saved." in banner and "the reference fails the verifier" in banner
    assert 'id="check-reference" data-passed="false"' in html
    assert json.loads(_textarea(html, "f-reference-calls")) == json.loads(WRONG_REFERENCE)  # kept as typed
    assert suite.cases.count() == 0


def test_a_field_that_does_not_parse_is_shown_back_as_typed(client_for, user, project, trajectory, suite, corrected):
    client = client_for(user)
    url = reverse("promotion_form", args=[project.slug, trajectory.pk])
    typed = '[{"name": "refund", "arguments": {"amount": 50,}}'
    response = _save(client, url, corrected, suite, reference_calls=typed)
    html = response.content.decode()
    assert response.status_code == 422
    assert "Not saved." in html and "reference_calls: not valid JSON" in html
    assert _textarea(html, "f-reference-calls") == typed
    assert suite.cases.count() == 0


def test_a_plain_check_is_no_failed_save(client_for, user, project, trajectory, suite, corrected):
    client = client_for(user)
    url = reverse("promotion_form", args=[project.slug, trajectory.pk])
    response = _save(client, url, corrected, suite, action="check", reference_calls=WRONG_REFERENCE)
    assert response.status_code == 200 and 'id="not-saved"' not in response.content.decode()
