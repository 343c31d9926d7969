"""The API docs page in real Chromium: Swagger UI runs from the app's own files under the strict CSP."""

from __future__ import annotations

from playwright.sync_api import expect


def test_the_api_docs_render_offline_under_the_csp(open_page, user):
    page = open_page(user)
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto("/api/v1/docs")
    # Swagger UI builds these from /api/v1/openapi.json: they exist only if its script ran.
    expect(page.locator(".opblock-summary-path", has_text="/api/v1/otlp/v1/traces")).to_be_visible()
    expect(page.locator(".opblock-summary-path", has_text="/api/v1/trajectories").first).to_be_visible()
    base = page.url.split("/api/")[0]
    assert requested and all(url.startswith(base) for url in requested), requested
    assert page.log.console_errors == [] and page.log.page_errors == []
