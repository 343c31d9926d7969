"""The REST API: body shapes, per-record answers, auth and scopes, limits, listing and reading."""

from __future__ import annotations

import datetime as dt
import gzip
import io
import json
import threading

import pytest
from django.db import connection
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext

from flywheel.accounts.services import api_key_revoke
from flywheel.trajectories import selectors
from flywheel.trajectories.models import Trajectory

URL = "/api/v1/trajectories"


@pytest.fixture
def client(api_client, api_key):
    return api_client.with_key(api_key)


def test_one_object(client, project, make_record):
    response = client.post(URL, make_record("t-1"))
    assert response.status_code == 200, response.content
    stored = Trajectory.objects.get(project=project, external_id="t-1")
    assert response.json() == {"accepted": 1, "created": 1, "updated": 0, "rejected": [],
                               "records": [{"index": 0, "external_id": "t-1", "id": stored.pk}]}
    assert stored.source == "api"


def test_array_with_a_bad_record(client, project, make_record):
    bad = make_record("t-bad")
    bad["messages"][2]["tool_calls"][0]["function"]["name"] = 7
    response = client.post(URL, [make_record("t-1"), bad, make_record("t-2")])
    assert response.status_code == 200
    body = response.json()
    assert (body["accepted"], body["created"], body["updated"]) == (2, 2, 0)
    assert body["rejected"][0]["index"] == 1
    assert body["rejected"][0]["external_id"] == "t-bad"
    assert body["rejected"][0]["errors"][0]["field"] == "messages[2].tool_calls[0].function.name"
    assert Trajectory.objects.filter(project=project).count() == 2
    # Each accepted record with its trajectory's id, so that a script can go on without a search.
    ids = dict(Trajectory.objects.filter(project=project).values_list("external_id", "id"))
    assert body["records"] == [{"index": 0, "external_id": "t-1", "id": ids["t-1"]},
                               {"index": 2, "external_id": "t-2", "id": ids["t-2"]}]
    assert client.get(f"{URL}/{body['records'][1]['id']}").json()["external_id"] == "t-2"


def test_ndjson_rejections_name_the_line_counting_blank_ones(client, project, make_record):
    bad = json.dumps(make_record("t-bad", outcome="great"))
    lines = [json.dumps(make_record("t-1")), "", "{not json", "  ", bad, json.dumps(make_record("t-2"))]
    response = client.post(URL, body="\n".join(lines) + "\n", content_type="application/x-ndjson")
    assert response.status_code == 200
    body = response.json()
    assert body["accepted"] == 2
    assert [(r["index"], r["external_id"]) for r in body["rejected"]] == [(2, None), (4, "t-bad")]
    assert [(r["index"], r["external_id"]) for r in body["records"]] == [(0, "t-1"), (5, "t-2")]
    assert "not valid JSON" in body["rejected"][0]["errors"][0]["message"]
    assert body["rejected"][1]["errors"][0]["field"] == "outcome"


def test_replay_updates(client, project, make_record):
    first = client.post(URL, [make_record("t-1"), make_record("t-2")]).json()["records"]
    response = client.post(URL, [make_record("t-1", outcome="failure"), make_record("t-3"), make_record("t-3")])
    body = response.json()
    assert {k: body[k] for k in ("accepted", "created", "updated", "rejected")} == {
        "accepted": 3, "created": 1, "updated": 2, "rejected": []}
    assert Trajectory.objects.filter(project=project).count() == 3
    # A replay names the trajectory it updated; a record repeated in one batch names the one row it became.
    assert body["records"][0] == {"index": 0, "external_id": "t-1", "id": first[0]["id"]}
    assert body["records"][1]["id"] == body["records"][2]["id"] == Trajectory.objects.get(external_id="t-3").pk


def test_every_record_rejected_is_422_with_the_same_shape(client):
    response = client.post(URL, [{"external_id": "x"}])
    assert response.status_code == 422
    assert response.json()["rejected"][0]["errors"][0]["field"] == "messages"
    assert response.json()["records"] == []


def test_invalid_json_is_400(client):
    response = client.post(URL, body="{oops", content_type="application/json")
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["detail"]


def test_a_body_nested_absurdly_deep_is_400(client):
    assert client.post(URL, body="[" * 100_000, content_type="application/json").status_code == 400


def test_gzip_body(client, make_record):
    body = gzip.compress(json.dumps([make_record("t-1")]).encode())
    response = client.post(
        URL, body=body, content_type="application/json", headers={"Content-Encoding": "gzip"}
    )
    assert response.status_code == 200
    assert response.json()["created"] == 1


@override_settings(FLYWHEEL_MAX_REQUEST_BYTES=2_000)
def test_too_large_by_content_length_is_413_with_the_limit(client, make_record):
    response = client.post(URL, [make_record(f"t-{i}") for i in range(5)])
    assert response.status_code == 413
    assert "2000 bytes" in response.json()["detail"]
    assert not Trajectory.objects.exists()


@override_settings(FLYWHEEL_MAX_REQUEST_BYTES=2_000)
def test_too_large_after_decompression_is_413(client, make_record):
    body = gzip.compress(json.dumps([make_record(f"t-{i}") for i in range(50)]).encode())
    assert len(body) < 2_000
    response = client.post(
        URL, body=body, content_type="application/json", headers={"Content-Encoding": "gzip"}
    )
    assert response.status_code == 413
    assert "2000" in response.json()["detail"]


@override_settings(FLYWHEEL_MAX_BATCH_RECORDS=3)
def test_too_many_records_is_413(client, make_record):
    response = client.post(URL, [make_record(f"t-{i}") for i in range(4)])
    assert response.status_code == 413
    assert "limit is 3" in response.json()["detail"]


class _ResetStream(io.BytesIO):
    """wsgi.input of a client that reset the connection mid-body: what gunicorn's reader raises then."""

    def read(self, size: int | None = -1) -> bytes:
        raise ConnectionResetError(104, "Connection reset by peer")


@pytest.mark.parametrize("broken", ["closed early", "reset"])
def test_a_body_the_client_breaks_off_is_400_and_stores_nothing(client, make_record, broken):
    # Three NDJSON lines, of which the server gets two whole ones: a valid prefix of what was declared.
    body = "".join(json.dumps(make_record(f"t-{i}")) + "\n" for i in range(3)).encode()
    cut = body.index(b"\n", body.index(b"\n") + 1) + 1
    stream = io.BytesIO(body[:cut]) if broken == "closed early" else _ResetStream(body)
    response = client.client.post(
        URL, b"", content_type="application/x-ndjson", headers={"Authorization": f"Bearer {client.key}"},
        CONTENT_LENGTH=str(len(body)), **{"wsgi.input": stream},
    )  # fmt: skip
    assert response.status_code == 400, response.content
    detail = response.json()["detail"]
    assert f"ended after {cut} of the {len(body)} bytes" in detail if broken == "closed early" else "reset" in detail
    assert not Trajectory.objects.exists()


def test_no_key_is_401(api_client, make_record):
    response = api_client.post(URL, make_record("t-1"))
    assert response.status_code == 401
    assert "Bearer" in response.json()["detail"]
    assert api_client.get(URL).status_code == 401


def test_unknown_or_revoked_key_is_401(api_client, api_key, make_record):
    assert api_client.post(URL, make_record("t-1"), key="fw_nope_nope").status_code == 401
    api_key_revoke(api_key=api_key.api_key)
    assert api_client.post(URL, make_record("t-1"), key=api_key).status_code == 401


def test_missing_scope_is_403(api_client, project, make_api_key, make_record):
    read_only = make_api_key(project, scopes=["read"])
    ingest_only = make_api_key(project, scopes=["ingest"])
    response = api_client.post(URL, make_record("t-1"), key=read_only)
    assert response.status_code == 403
    assert "ingest" in response.json()["detail"]
    assert api_client.post(URL, make_record("t-1"), key=ingest_only).status_code == 200
    assert api_client.get(URL, key=ingest_only).status_code == 403
    assert api_client.get(URL, key=read_only).status_code == 200


def test_another_projects_key_is_403_and_sees_nothing(
    api_client, project, api_key, make_project, make_api_key, make_record
):
    other = make_project()
    other_key = make_api_key(other)
    api_client.post(URL, make_record("t-1"), key=api_key)
    mine = Trajectory.objects.get(project=project)
    # Naming a project that is not the key's.
    response = api_client.post(f"{URL}?project={project.slug}", make_record("t-2"), key=other_key)
    assert response.status_code == 403
    assert other.slug in response.json()["detail"]
    assert api_client.get(URL, {"project": project.slug}, key=other_key).status_code == 403
    # The other key lists its own (empty) project, and cannot read this project's trajectory.
    assert api_client.get(URL, key=other_key).json()["items"] == []
    assert api_client.get(f"{URL}/{mine.pk}", key=other_key).status_code == 404
    # Ingesting with the other key writes into the other project only.
    api_client.post(URL, make_record("t-1", agent="other"), key=other_key)
    assert Trajectory.objects.get(project=project).agent == "support-bot"
    assert api_client.get(f"{URL}?project={project.slug}", key=api_key).status_code == 200


def test_list_filters_and_keyset_pagination(client, project, make_record):
    records = [make_record(f"t-{i}", outcome="failure" if i % 2 else "success") for i in range(7)]
    records[3]["messages"][3]["content"] = "Error: boom"
    client.post(URL, records)

    seen, cursor = [], None
    while True:
        params = {"limit": 3, **({"cursor": cursor} if cursor else {})}
        page = client.get(URL, params).json()
        seen += [item["external_id"] for item in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert sorted(seen) == sorted(r["external_id"] for r in records)
    assert len(seen) == len(set(seen))
    ids = [item["id"] for item in client.get(URL, {"limit": 10}).json()["items"]]
    assert ids == sorted(ids, reverse=True)

    failures = client.get(URL, {"outcome": "failure"}).json()["items"]
    assert {i["external_id"] for i in failures} == {"t-1", "t-3", "t-5"}
    errors = client.get(URL, {"has_tool_error": "true"}).json()["items"]
    assert [i["external_id"] for i in errors] == ["t-3"]
    assert client.get(URL, {"q": "ORDER 1234"}).json()["items"]
    assert client.get(URL, {"q": "nothing like this"}).json()["items"] == []
    assert client.get(URL, {"external_id": "t-4"}).json()["items"][0]["external_id"] == "t-4"
    assert client.get(URL, {"reviewed_outcome": "none"}).json()["items"]
    assert client.get(URL, {"started_after": "2027-01-01T00:00:00Z"}).json()["items"] == []
    assert client.get(URL, {"limit": 0}).status_code == 422
    assert client.get(URL, {"cursor": "abc"}).status_code == 400


def _pages(client, params):
    """Every page of a listing, following next_cursor; and whether the ids were read from the filter's own
    index (`ORDER BY id + 0`) rather than by walking the id index."""
    pages, cursor, by_filter_index = [], None, []
    while True:
        with CaptureQueriesContext(connection) as queries:
            page = client.get(URL, {**params, **({"cursor": cursor} if cursor else {})}).json()
        by_filter_index.append(any('"id" + 0)' in q["sql"] for q in queries.captured_queries))
        pages.append([item["external_id"] for item in page["items"]])
        cursor = page["next_cursor"]
        if cursor is None:
            return pages, by_filter_index


def test_the_list_reads_few_matches_from_the_filters_index(client, project, make_record, monkeypatch):
    """Like the list page: a walk of the id index would cross every other row to find a few matches."""
    monkeypatch.setattr(selectors, "SPARSE_MATCHES", 3)
    client.post(URL, [make_record(f"t-{i}", agent="rare" if i in (1, 4, 6) else "common") for i in range(8)])

    pages, by_filter_index = _pages(client, {"agent": "rare", "limit": 2})
    assert pages == [["t-6", "t-4"], ["t-1"]]
    assert by_filter_index == [True, True]

    pages, by_filter_index = _pages(client, {"agent": "common", "limit": 2})
    assert pages == [["t-7", "t-5"], ["t-3", "t-2"], ["t-0"]]
    assert by_filter_index == [False, True, True]  # past the first page three matches are left: few

    pages, by_filter_index = _pages(client, {"started_before": "2027-01-01T00:00:00Z", "limit": 5})
    assert pages == [["t-7", "t-6", "t-5", "t-4", "t-3"], ["t-2", "t-1", "t-0"]]
    assert all(by_filter_index)  # an end date: matches may lie far back

    pages, by_filter_index = _pages(client, {"limit": 5})
    assert pages == [["t-7", "t-6", "t-5", "t-4", "t-3"], ["t-2", "t-1", "t-0"]]
    assert not any(by_filter_index)  # no filter: the id walk is the fastest read


def test_the_date_filters_find_a_trajectory_sent_without_started_at(client, project, make_record):
    record = make_record("no-start")
    del record["started_at"]
    client.post(URL, record)
    received = Trajectory.objects.get(project=project, external_id="no-start").created_at
    window = {
        "started_after": (received - dt.timedelta(minutes=1)).isoformat(),
        "started_before": (received + dt.timedelta(minutes=1)).isoformat(),
    }
    items = client.get(URL, window).json()["items"]
    assert [i["external_id"] for i in items] == ["no-start"]
    assert items[0]["started_at"] is not None


def test_detail(client, project, make_record):
    client.post(URL, make_record("t-1"))
    trajectory = Trajectory.objects.get(project=project)
    body = client.get(f"{URL}/{trajectory.pk}").json()
    assert body["external_id"] == "t-1"
    assert body["messages"][2]["tool_calls"][0]["function"]["name"] == "get_order"
    assert body["tools"][0]["function"]["name"] == "get_order"
    assert body["tool_call_count"] == 1
    assert body["tags"] == [] and body["comments"] == []
    assert client.get(f"{URL}/999999").status_code == 404


def test_openapi_is_published(client):
    response = client.client.get("/api/v1/openapi.json")
    assert response.status_code == 200
    schema = response.json()
    assert {"/api/v1/trajectories", "/api/v1/trajectories/{trajectory_id}", "/api/v1/otlp/v1/traces"} <= set(
        schema["paths"]
    )
    assert "TrajectoryIn" in schema["components"]["schemas"]
    assert "project" in schema["components"]["securitySchemes"]["ApiKeyAuth"]["description"]
    assert "key's project" in schema["info"]["description"]


def test_a_numeric_external_id_is_taken_as_a_string(client, project, make_record):
    assert client.post(URL, make_record(42)).json()["created"] == 1
    assert Trajectory.objects.get(project=project).external_id == "42"


@pytest.mark.django_db(transaction=True)
def test_the_same_batch_posted_twice_at_once_is_stored_once(needs_postgres, project, api_key, make_record):
    records = [make_record(f"t-{i}") for i in range(200)]
    barrier = threading.Barrier(2)
    answers, errors = [], []

    def post() -> None:
        try:
            client = Client()
            barrier.wait()
            response = client.post(
                URL,
                json.dumps(records),
                content_type="application/json",
                headers={"Authorization": f"Bearer {api_key}"},
            )
            answers.append(response.json())
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=post) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert Trajectory.objects.filter(project=project).count() == 200
    assert len(answers) == 2
    assert sum(a["created"] for a in answers) == 200 and sum(a["updated"] for a in answers) == 200


# --- query values that answered 500 ------------------------------------------------------------------------


def test_the_text_search_takes_at_most_200_characters(client, project, make_record):
    # Uncapped, a long q is a LIKE pattern SQLite refuses past 50,000 bytes ("pattern too complex": 500).
    client.post(URL, make_record("t-1"))
    assert client.get(URL, {"q": "x" * 200}).json()["items"] == []
    response = client.get(URL, {"q": "x" * 100_000})
    assert response.status_code == 422
    [problem] = response.json()["detail"]
    assert problem["loc"] == ["query", "q"] and "at most 200 characters" in problem["msg"]


@pytest.mark.parametrize("name", ["q", "agent", "model_version", "source", "external_id"])
def test_a_nul_in_a_text_filter_is_422_naming_it(client, project, make_record, name):
    # PostgreSQL's driver refuses a query carrying NUL: the list answered 500 there.
    client.post(URL, make_record("t-1"))
    response = client.get(URL, {name: "t-1\x00"})
    assert response.status_code == 422
    [problem] = response.json()["detail"]
    assert problem["loc"] == ["query", name] and "NUL" in problem["msg"]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"started_before": "9999-12-31T23:59:59-01:00"}, ["t-1"]),  # year 10000 in UTC: OverflowError on SQLite
        ({"started_after": "0001-01-01T00:00:00+01:00"}, ["t-1"]),  # year 0 in UTC
        ({"started_after": "9999-12-31T23:59:59-01:00"}, []),
        ({"started_before": "0001-01-01T00:00:00+01:00"}, []),
        ({"started_after": "2026-12-01T10:00:00", "started_before": "2026-12-01T10:00:01"}, ["t-1"]),  # naive: UTC
        ({"started_after": "2026-12-01T10:00:01"}, []),
    ],
)
def test_dates_at_the_ends_of_the_calendar_and_naive_ones(client, project, make_record, params, expected):
    client.post(URL, make_record("t-1"))  # started 2026-12-01T10:00:00Z
    response = client.get(URL, params)
    assert response.status_code == 200, response.content
    assert [item["external_id"] for item in response.json()["items"]] == expected


def test_cursors_and_ids_past_any_id_find_nothing_not_a_500(client, project, make_record):
    client.post(URL, make_record("t-1"))
    assert [i["external_id"] for i in client.get(URL, {"cursor": "9" * 30}).json()["items"]] == ["t-1"]
    for cursor in ("²", "١٢", " 12", "-1"):  # not ASCII digits: not a cursor this API gave out
        response = client.get(URL, {"cursor": cursor})
        assert response.status_code == 400 and response.json() == {"detail": "cursor is not one this API gave out."}
    # An id no row can have (past 64 bits) is refused by the schema's bound, naming the parameter.
    past = client.get(f"{URL}/{'9' * 30}")
    assert past.status_code == 422 and past.json()["detail"][0]["loc"] == ["path", "trajectory_id"]


@pytest.mark.parametrize("value", ["1700000000", "0.5", "nan"])
def test_a_date_filter_is_iso_8601_not_a_number(client, value):
    # pydantic alone reads a number as Unix time, which the schema (format: date-time) does not offer.
    response = client.get(URL, {"started_before": value})
    assert response.status_code == 422
    [problem] = response.json()["detail"]
    assert problem["loc"] == ["query", "started_before"] and "ISO 8601" in problem["msg"]
