"""The client's transport against stand-in servers: retries that honour Retry-After, the bounded retries of a
connection that cannot be made, the User-Agent, and the API version check."""

from __future__ import annotations

import socket

import pytest
from flywheel_client import ApiError, Flywheel, IncompatibleServer, ServerUnreachable, __version__

VERSION = {"api_version": "1", "platform_version": "0.1.0"}
INGESTED = {"accepted": 1, "created": 1, "updated": 0, "rejected": [],
            "records": [{"index": 0, "external_id": "t-1", "id": 7}]}
RECORD = {"external_id": "t-1", "messages": [{"role": "user", "content": "hi"}]}


def test_a_429_is_retried_after_the_seconds_the_server_asks_for(stand_in):
    posts = []

    def handler(request):
        if request.path == "/api/v1/version":
            return 200, {}, VERSION
        posts.append(request)
        if len(posts) == 1:
            return 429, {"Retry-After": "1"}, {"detail": "Too many requests."}
        return 200, {}, INGESTED

    server = stand_in(handler)
    with Flywheel(server.url, "fw_key") as client:
        result = client.ingest([RECORD])
    assert (result.accepted, result.records[0].id) == (1, 7)
    assert len(posts) == 2 and posts[0].body == posts[1].body == RECORD  # the same batch, sent again
    assert posts[1].at - posts[0].at >= 1.0
    assert posts[0].headers["Authorization"] == "Bearer fw_key"
    assert posts[0].headers["User-Agent"].startswith(f"flywheel-client/{__version__} ")


def test_a_503_without_retry_after_backs_off_and_gives_up_after_the_bound(stand_in):
    server = stand_in(lambda request: (200, {}, VERSION) if request.path.endswith("/version")
                      else (503, {}, {"detail": "The database is unavailable."}))
    waits = []
    with Flywheel(server.url, "k", max_retries=2, sleep=waits.append) as client:
        with pytest.raises(ApiError, match="answered 503: The database is unavailable"):
            client.production()
    assert len(waits) == 2 and all(0 < w <= 60 for w in waits)
    assert len(server.requests) == 1 + 3


def test_a_server_that_cannot_be_reached_is_tried_a_bounded_number_of_times():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    waits = []
    with Flywheel(f"http://127.0.0.1:{port}", "k", max_retries=3, sleep=waits.append) as client:
        with pytest.raises(ServerUnreachable, match="no answer after 4 tries"):
            client.status()
    assert len(waits) == 3


def test_a_server_of_another_major_version_is_refused_with_both_versions(stand_in):
    server = stand_in(lambda request: (200, {}, {"api_version": "2", "platform_version": "2.0.0"}))
    with Flywheel(server.url, "k") as client:
        with pytest.raises(IncompatibleServer, match=r"speaks version 2 of the Flywheel API; flywheel-client "
                                                     r"\S+ speaks version 1"):
            client.status()
    assert [r.path for r in server.requests] == ["/api/v1/version"]  # nothing else was sent


def test_without_the_version_endpoint_the_openapi_schema_says_the_version(stand_in):
    def handler(request):
        if request.path == "/api/v1/version":
            return 404, {}, {"detail": "Not Found"}
        if request.path == "/api/v1/openapi.json":
            return 200, {}, {"openapi": "3.1.0", "info": {"title": "Flywheel API", "version": "1"}}
        return 404, {}, {"detail": "No model is in production in this project yet."}

    server = stand_in(handler)
    with Flywheel(server.url, "k") as client:
        assert client.production() is None
        assert client.server_version().api_version == "1"
    assert [r.path for r in server.requests] == ["/api/v1/version", "/api/v1/openapi.json",
                                                 "/api/v1/models/production"]


def test_a_url_that_is_not_the_flywheel_api_is_refused_by_name(stand_in):
    server = stand_in(lambda request: (200, {"Content-Type": "text/html"}, "<html>a shop</html>"))
    with Flywheel(server.url + "/shop", "k") as client:
        with pytest.raises(IncompatibleServer, match=r"/shop/api/v1/version is not the Flywheel API"):
            client.status()
