"""The 404 page under DEBUG (`make run`): the project's own page, which the Content-Security-Policy lets
render, not Django's technical page with its inline <style>; the API's 404 stays JSON."""

from __future__ import annotations


def test_a_missing_page_under_debug_is_the_project_s_404(client_for, user, project, settings):
    settings.DEBUG = True
    client = client_for(user)
    for url in ("/no-such-page/", f"/p/{project.slug}/no-such-page/", "/p/no-such-project/", f"/p/{project.slug}/t/999999/"):
        response = client.get(url)
        page = response.content.decode()
        assert response.status_code == 404, url
        assert "<h1>Not found</h1>" in page and "<style" not in page and " style=" not in page, url
        assert "style-src 'self'" in response["Content-Security-Policy"]


def test_the_api_s_404_is_left_as_it_is(client, settings):
    settings.DEBUG = True
    response = client.get("/api/v1/no-such-operation")
    assert response.status_code == 404
    assert "<h1>Not found</h1>" not in response.content.decode()
