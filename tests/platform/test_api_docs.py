"""The API docs page works offline: Swagger UI comes from the app's own static files, never a CDN."""

from __future__ import annotations

import re

import pytest


@pytest.mark.django_db
def test_docs_page_loads_only_local_assets(client):
    page = client.get("/api/v1/docs")
    assert page.status_code == 200
    body = page.content.decode()
    assets = re.findall(r'(?:src|href)="([^"]+)"', body)
    assert any(a.endswith("swagger-ui-bundle.js") for a in assets)
    assert not [a for a in assets if "//" in a], assets
    for asset in assets:
        assert client.get(asset).status_code == 200, asset
    # Executable inline scripts would be refused by the page's CSP; only JSON data may be inline.
    inline = re.findall(r"<script(?![^>]*\bsrc=)([^>]*)>", body)
    assert all("application/json" in attrs for attrs in inline), inline
