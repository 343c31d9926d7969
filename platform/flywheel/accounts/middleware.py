"""A strict Content-Security-Policy: scripts only from this origin, no inline script.

Agent content is always escaped in templates; this is the second wall, so that a payload that ever
slipped through escaping still could not run."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'self'; frame-ancestors 'none'; form-action 'self'"
)


class ContentSecurityPolicyMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        response.headers.setdefault("Content-Security-Policy", POLICY)
        return response


class NotFoundPageMiddleware:
    """Under DEBUG (`make run`) Django answers a 404 with its technical page, whose inline <style> the policy
    above blocks: a console error on every mistyped URL. The project's own 404 page answers instead, as in
    production (the path is still in the server's log). The API's JSON 404s are left as they are."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if (settings.DEBUG and response.status_code == 404 and not request.path.startswith("/api/")
                and response.get("Content-Type", "").startswith("text/html")):
            return render(request, "404.html", status=404)
        return response
