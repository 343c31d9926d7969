"""Review services and the review pages: who may see and change what (every view and htmx endpoint),
what the htmx endpoints answer, and that agent content comes out escaped."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from flywheel.failures import review
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Comment, Tag, Trajectory

HTMX = {"HX-Request": "true"}


def record(external_id: str = "t-1", **overrides):
    rec = {
        "external_id": external_id,
        "agent": "support-bot",
        "model_version": "v3",
        "messages": [
            {"role": "system", "content": "You are a support agent."},
            {"role": "user", "content": "Where is my order 1234?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_order", "arguments": '{"order_id": "1234"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Error: order service timed out"},
            {"role": "assistant", "content": "Sorry, I could not look it up."},
        ],
        "tools": [{"type": "function", "function": {"name": "get_order", "parameters": {"type": "object"}}}],
        "outcome": "failure",
        "latency_ms": 1830,
        "usage": {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150},
        "metadata": {"region": "eu"},
        "started_at": "2026-12-01T10:00:00Z",
    }
    rec.update(overrides)
    return rec


@pytest.fixture
def trajectory(project):
    result = ingest_trajectories(project=project, records=[record()])
    assert result.accepted == 1, result.rejected
    return Trajectory.objects.get(project=project, external_id="t-1")


@pytest.fixture
def member(make_user, make_membership, project):
    """`member(role)` -> a user with that role in `project`."""

    def make(role: str):
        user = make_user()
        make_membership(user, project, role)
        return user

    return make


# --- services ---------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_outcome_set_wins_over_the_agent_and_can_be_cleared(trajectory, user):
    review.trajectory_outcome_set(trajectory=trajectory, outcome="success", user=user)
    trajectory.refresh_from_db()
    assert (trajectory.outcome, trajectory.effective_outcome) == ("failure", "success")
    assert trajectory.reviewed_by == user and trajectory.reviewed_at is not None

    review.trajectory_outcome_set(trajectory=trajectory, outcome="", user=user)
    trajectory.refresh_from_db()
    assert trajectory.effective_outcome == "failure" and trajectory.reviewed_by is None

    with pytest.raises(ValidationError, match="Unknown outcome"):
        review.trajectory_outcome_set(trajectory=trajectory, outcome="great", user=user)


@pytest.mark.django_db
def test_review_survives_a_replay(project, trajectory, user):
    review.trajectory_outcome_set(trajectory=trajectory, outcome="success", user=user)
    review.trajectory_tag_add(trajectory=trajectory, name="timeout")
    review.trajectory_comment_add(trajectory=trajectory, author=user, body="retry missing", message_index=3)
    ingest_trajectories(project=project, records=[record(outcome="unknown")])
    trajectory.refresh_from_db()
    assert trajectory.effective_outcome == "success"
    assert [t.name for t in trajectory.tags.all()] == ["timeout"]
    assert trajectory.comments.count() == 1


@pytest.mark.django_db
def test_comment_add_on_a_message_or_the_trajectory(trajectory, user):
    on_message = review.trajectory_comment_add(trajectory=trajectory, author=user, body="  wrong id  ", message_index=2)
    assert (on_message.body, on_message.message_index) == ("wrong id", 2)
    overall = review.trajectory_comment_add(trajectory=trajectory, author=user, body="Gave up too early")
    assert overall.message_index is None
    with pytest.raises(ValidationError, match="some text"):
        review.trajectory_comment_add(trajectory=trajectory, author=user, body="   ")
    with pytest.raises(ValidationError, match="No message 5; this trajectory has 5"):
        review.trajectory_comment_add(trajectory=trajectory, author=user, body="x", message_index=5)
    with pytest.raises(ValidationError, match="No message -1"):
        review.trajectory_comment_add(trajectory=trajectory, author=user, body="x", message_index=-1)


@pytest.mark.django_db
def test_tag_add_is_idempotent_and_remove_keeps_the_tag(trajectory):
    tag = review.trajectory_tag_add(trajectory=trajectory, name="  wrong   tool ")
    again = review.trajectory_tag_add(trajectory=trajectory, name="wrong tool")
    assert tag == again and tag.name == "wrong tool"
    assert list(trajectory.tags.all()) == [tag]
    review.trajectory_tag_remove(trajectory=trajectory, tag=tag)
    assert trajectory.tags.count() == 0 and Tag.objects.filter(pk=tag.pk).exists()
    with pytest.raises(ValidationError, match="at most 64"):
        review.trajectory_tag_add(trajectory=trajectory, name="x" * 65)
    with pytest.raises(ValidationError, match="needs a name"):
        review.trajectory_tag_add(trajectory=trajectory, name=" ")


# --- permissions on every view and endpoint --------------------------------------------------------------


def endpoints(project, trajectory, tag):
    """(method, url, data) for every review view and htmx endpoint."""
    args = [project.slug, trajectory.id]
    return [
        ("get", reverse("trajectory_list", args=[project.slug]), None),
        ("get", reverse("trajectory_detail", args=args), None),
        ("post", reverse("trajectory_outcome_set", args=args), {"outcome": "success"}),
        ("post", reverse("trajectory_comment_add", args=args), {"body": "hi", "message_index": "1"}),
        ("post", reverse("trajectory_tag_add", args=args), {"name": "new"}),
        ("post", reverse("trajectory_tag_remove", args=[*args, tag.id]), {}),
    ]


@pytest.fixture
def tag(trajectory):
    return review.trajectory_tag_add(trajectory=trajectory, name="existing")


def call(client, method, url, data, **headers):
    return getattr(client, method)(url, data or {}, headers=headers)


@pytest.mark.django_db
def test_anonymous_users_go_to_login_everywhere(client_for, project, trajectory, tag):
    client = client_for(None)
    for method, url, data in endpoints(project, trajectory, tag):
        response = call(client, method, url, data)
        assert response.status_code == 302, url
        assert response.url.startswith(reverse("login")), url


@pytest.mark.django_db
def test_non_members_get_404_everywhere(client_for, make_user, project, trajectory, tag):
    client = client_for(make_user())
    for method, url, data in endpoints(project, trajectory, tag):
        assert call(client, method, url, data).status_code == 404, url


@pytest.mark.django_db
def test_viewers_read_but_every_write_is_403(client_for, member, project, trajectory, tag):
    client = client_for(member("viewer"))
    for method, url, data in endpoints(project, trajectory, tag):
        response = call(client, method, url, data, **HTMX)
        assert response.status_code == (200 if method == "get" else 403), url
    trajectory.refresh_from_db()
    assert trajectory.reviewed_outcome == "" and not Comment.objects.exists()
    assert [t.name for t in trajectory.tags.all()] == ["existing"]
    page = client.get(reverse("trajectory_detail", args=[project.slug, trajectory.id])).content.decode()
    assert "trajectory_outcome_set" not in page and 'name="outcome"' not in page and "Add comment" not in page


@pytest.mark.django_db
@pytest.mark.parametrize("role", ["reviewer", "maintainer"])
def test_reviewers_and_maintainers_write(client_for, member, project, trajectory, tag, role):
    client = client_for(member(role))
    for method, url, data in endpoints(project, trajectory, tag):
        assert call(client, method, url, data, **HTMX).status_code == 200, url
    trajectory.refresh_from_db()
    assert trajectory.reviewed_outcome == "success"
    assert [t.name for t in trajectory.tags.all()] == ["new"]
    assert Comment.objects.get().message_index == 1


@pytest.mark.django_db
def test_another_projects_trajectory_or_tag_is_404(client_for, member, make_project, project, trajectory, tag):
    other = make_project()
    ingest_trajectories(project=other, records=[record("foreign")])
    foreign = Trajectory.objects.get(project=other)
    foreign_tag = review.trajectory_tag_add(trajectory=foreign, name="theirs")
    client = client_for(member("reviewer"))
    assert client.get(reverse("trajectory_detail", args=[project.slug, foreign.id])).status_code == 404
    url = reverse("trajectory_outcome_set", args=[project.slug, foreign.id])
    assert client.post(url, {"outcome": "success"}).status_code == 404
    url = reverse("trajectory_tag_remove", args=[project.slug, trajectory.id, foreign_tag.id])
    assert client.post(url).status_code == 404
    assert client.get(reverse("trajectory_detail", args=[project.slug, 999_999])).status_code == 404


@pytest.mark.django_db
def test_writes_need_post(client_for, member, project, trajectory):
    client = client_for(member("reviewer"))
    assert client.get(reverse("trajectory_outcome_set", args=[project.slug, trajectory.id])).status_code == 405


# --- what the pages and fragments answer -----------------------------------------------------------------


@pytest.mark.django_db
def test_list_page_and_its_htmx_fragment(client_for, user, project, trajectory):
    client = client_for(user)
    url = reverse("trajectory_list", args=[project.slug])
    page = client.get(url, {"outcome": "failure"}).content.decode()
    assert "<html" in page and 'id="filters"' in page and f'id="row-{trajectory.id}"' in page
    assert "Where is my order 1234?" in page
    fragment = client.get(url, {"outcome": "failure"}, headers={**HTMX, "HX-Target": "results"}).content.decode()
    assert "<html" not in fragment and 'id="filters"' not in fragment and f'id="row-{trajectory.id}"' in fragment
    # The row is the same markup in the page and in the fragment.
    start = fragment.index(f'<tr class="row has-error" id="row-{trajectory.id}"')
    row = fragment[start : fragment.index("</tr>", start)]
    assert row in page
    empty = client.get(url, {"outcome": "success"}, headers={**HTMX, "HX-Target": "results"}).content.decode()
    assert "No trajectories match these filters." in empty
    bad = client.get(url, {"date_from": "soon"}).content.decode()
    assert "Ignored From date &#x27;soon&#x27;: it is not a date (YYYY-MM-DD)." in bad


@pytest.mark.django_db
def test_list_pages_with_a_cursor(client_for, user, project):
    ingest_trajectories(project=project, records=[record(f"t{i}") for i in range(55)])
    client = client_for(user)
    url = reverse("trajectory_list", args=[project.slug])
    first = client.get(url)
    ids = sorted(Trajectory.objects.values_list("id", flat=True), reverse=True)
    assert len(first.context["page"].rows) == 50 and first.context["page"].next_cursor == ids[49]
    assert f"after={ids[49]}" in first.content.decode()
    second = client.get(url, {"after": ids[49]})
    assert [t.id for t in second.context["page"].rows] == ids[50:]
    assert f"before={ids[50]}" in second.content.decode()
    assert [c.display for c in first.context["counts"]] == ["55", "0", "55", "0"]


@pytest.mark.django_db
def test_detail_page_shows_the_conversation(client_for, user, project, trajectory):
    page = client_for(user).get(reverse("trajectory_detail", args=[project.slug, trajectory.id])).content.decode()
    assert "Where is my order 1234?" in page
    assert "get_order" in page and "&quot;order_id&quot;: &quot;1234&quot;" in page  # pretty JSON, escaped
    assert 'class="msg role-tool is-error"' in page and 'href="#tc-1"' in page and 'href="#m3"' in page
    assert "1.8 s" in page and "total</span> 150" in page


@pytest.mark.django_db
def test_detail_page_links_neighbours_within_the_filter(client_for, user, project):
    ingest_trajectories(
        project=project, records=[record("f1"), record("s1", outcome="success"), record("f2"), record("s2", outcome="success")]
    )
    ids = dict(Trajectory.objects.values_list("external_id", "id"))
    response = client_for(user).get(reverse("trajectory_detail", args=[project.slug, ids["f1"]]), {"outcome": "failure"})
    assert (response.context["newer_id"], response.context["older_id"]) == (ids["f2"], None)
    assert f'href="/p/{project.slug}/t/{ids["f2"]}/?outcome=failure"' in response.content.decode()


@pytest.mark.django_db
def test_htmx_outcome_set_answers_the_box_and_the_header_badge(client_for, member, project, trajectory):
    client = client_for(member("reviewer"))
    url = reverse("trajectory_outcome_set", args=[project.slug, trajectory.id])
    body = client.post(url, {"outcome": "success"}, headers=HTMX).content.decode()
    assert 'id="outcome"' in body and 'id="head-outcome" hx-swap-oob="true"' in body and "set by" in body
    bad = client.post(url, {"outcome": "great"}, headers=HTMX)
    assert bad.status_code == 422 and "Unknown outcome" in bad.content.decode()
    plain = client.post(url, {"outcome": "failure"})
    assert plain.status_code == 302 and plain.url == reverse("trajectory_detail", args=[project.slug, trajectory.id])


@pytest.mark.django_db
def test_htmx_comment_and_tag_fragments(client_for, member, project, trajectory):
    client = client_for(member("reviewer"))
    url = reverse("trajectory_comment_add", args=[project.slug, trajectory.id])
    body = client.post(url, {"body": "timeout not retried", "message_index": "3"}, headers=HTMX).content.decode()
    assert 'id="comments-3"' in body and "timeout not retried" in body
    empty = client.post(url, {"body": " ", "message_index": "3"}, headers=HTMX)
    assert empty.status_code == 422 and "needs some text" in empty.content.decode()
    overall = client.post(url, {"body": "gave up"}, headers=HTMX).content.decode()
    assert 'id="comments-t"' in overall

    url = reverse("trajectory_tag_add", args=[project.slug, trajectory.id])
    body = client.post(url, {"name": "timeout"}, headers=HTMX).content.decode()
    assert 'id="tags"' in body and "timeout" in body
    tag = Tag.objects.get(name="timeout")
    url = reverse("trajectory_tag_remove", args=[project.slug, trajectory.id, tag.id])
    assert "No tags." in client.post(url, headers=HTMX).content.decode()


PAYLOAD = "<script>window.__pwned=1</script><img src=x onerror=alert(1)>\"'><a href=\"javascript:alert(1)\">x</a>"


@pytest.mark.django_db
def test_agent_content_is_escaped_on_every_page(client_for, member, project):
    hostile = record(
        "x" + "\"'><b>",
        agent=PAYLOAD[:200],
        model_version="<img src=x onerror=alert(2)>",
        metadata={PAYLOAD: PAYLOAD},
        feedback={"comment": PAYLOAD},
        human_intervention={"note": PAYLOAD},
    )
    hostile["messages"][1]["content"] = PAYLOAD
    hostile["messages"][2]["tool_calls"][0]["function"] = {"name": "get_order", "arguments": '{"q": "' + PAYLOAD.replace('"', '\\"') + '"}'}
    hostile["messages"][3]["content"] = PAYLOAD
    result = ingest_trajectories(project=project, records=[hostile])
    assert result.accepted == 1, result.rejected
    trajectory = Trajectory.objects.get()
    review.trajectory_tag_add(trajectory=trajectory, name="<script>alert(3)</script>")
    reviewer = member("reviewer")
    review.trajectory_comment_add(trajectory=trajectory, author=reviewer, body=PAYLOAD, message_index=1)
    client = client_for(reviewer)
    for url in (
        reverse("trajectory_list", args=[project.slug]),
        reverse("trajectory_detail", args=[project.slug, trajectory.id]),
    ):
        page = client.get(url, {"q": "<script>"} if "t/" not in url else {}).content.decode()
        assert "<script>window" not in page and "<img src=x" not in page and 'href="javascript' not in page
        assert "<b>" not in page and "<script>alert(3)" not in page
        assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in page


# --- query strings and form values that answered 500 ------------------------------------------------------

# (query, the note the page shows; None: the value is valid and needs none). Each answered 500 before:
# date_to + 1 day overflowed, int("²") raised although "²".isdigit(), and PostgreSQL's driver refuses NUL.
BAD_QUERIES = [
    ({"date_to": "9999-12-31"}, None),
    ({"after": "²"}, "Ignored after &#x27;²&#x27;: it is not a page cursor (a trajectory id)."),
    ({"before": "²"}, "Ignored before &#x27;²&#x27;: it is not a page cursor (a trajectory id)."),
    ({"after": "9" * 30}, "Ignored after"),
    ({"q": "order\x00"}, "Ignored text search &#x27;order\\x00&#x27;: it contains a NUL character."),
    ({"agent": "support-bot\x00"}, "Ignored agent &#x27;support-bot\\x00&#x27;: it contains a NUL character."),
    ({"model_version": "\x00"}, "Ignored model version &#x27;\\x00&#x27;: it contains a NUL character."),
]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("page", "query", "note"),
    [
        (page, query, note)
        for page in ("list", "list fragment", "detail")
        for query, note in BAD_QUERIES
        if page != "detail" or not {"after", "before"} & set(query)  # the trajectory page takes no cursor
    ],
    ids=lambda v: "+".join(v) if isinstance(v, dict) else "no note" if v is None else "note" if v[0] == "I" else v,
)
def test_a_bad_query_value_is_ignored_and_the_page_says_so(client_for, user, project, trajectory, query, note, page):
    client = client_for(user)
    if page == "detail":
        response = client.get(reverse("trajectory_detail", args=[project.slug, trajectory.id]), query)
    else:
        headers = {**HTMX, "HX-Target": "results"} if page == "list fragment" else {}
        response = client.get(reverse("trajectory_list", args=[project.slug]), query, headers=headers)
        assert f'id="row-{trajectory.id}"' in response.content.decode()  # the rest of the filter still applies
        if page == "list fragment":
            assert response["HX-Push-Url"] == reverse("trajectory_list", args=[project.slug]) + (
                "?date_to=9999-12-31" if query == {"date_to": "9999-12-31"} else ""
            )
    assert response.status_code == 200
    html = response.content.decode()
    if note is None:
        assert 'aria-label="Ignored in the address"' not in html
    else:
        assert 'aria-label="Ignored in the address"' in html and note in html


@pytest.mark.django_db
@pytest.mark.parametrize("raw", ["²", "-²", "1.0", "one"])
def test_a_comment_on_a_message_index_that_is_no_number_is_400(client_for, member, project, trajectory, raw):
    client = client_for(member("reviewer"))
    url = reverse("trajectory_comment_add", args=[project.slug, trajectory.id])
    for headers in ({}, HTMX):
        response = client.post(url, {"body": "hi", "message_index": raw}, headers=headers)
        assert response.status_code == 400
        assert f"message_index {raw!r} is not a message number." in response.content.decode()
    assert not Comment.objects.exists()


@pytest.mark.django_db
def test_a_nul_in_a_comment_or_a_tag_is_refused_not_a_500(client_for, member, project, trajectory):
    client = client_for(member("reviewer"))
    comment = client.post(
        reverse("trajectory_comment_add", args=[project.slug, trajectory.id]),
        {"body": "a\x00b", "message_index": "1"},
        headers=HTMX,
    )
    assert comment.status_code == 422 and "A comment cannot contain a NUL character." in comment.content.decode()
    tag = client.post(reverse("trajectory_tag_add", args=[project.slug, trajectory.id]), {"name": "a\x00b"}, headers=HTMX)
    assert tag.status_code == 422 and "A tag name cannot contain a NUL character." in tag.content.decode()
    assert not Comment.objects.exists() and not Tag.objects.exists()


def test_tool_call_arguments_nested_past_the_recursion_limit_show_as_sent(client_for, user, project):
    # Arguments are kept as sent, so a string of JSON nested thousands deep is a valid record; the page must
    # show it as text rather than fail to pretty-print it.
    deep = "[" * 5000 + "]" * 5000
    hostile = record("deep-args")
    hostile["messages"][2]["tool_calls"][0]["function"]["arguments"] = deep
    result = ingest_trajectories(project=project, records=[hostile])
    assert result.accepted == 1
    trajectory = Trajectory.objects.get(project=project, external_id="deep-args")
    response = client_for(user).get(reverse("trajectory_detail", args=[project.slug, trajectory.id]))
    assert response.status_code == 200
    assert "[[[[[[[[" in response.content.decode()
