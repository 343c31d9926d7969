"""Browser fixtures: Django's live server and Debian's Chromium driven by Playwright.

Playwright's sync API runs an event loop in the test thread, and Django refuses ORM calls from a thread
with a running loop; the tests are synchronous code, so that guard is lifted for this folder."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/browser/" in str(item.path).replace(os.sep, "/"):
            item.add_marker(pytest.mark.browser)


@pytest.fixture(scope="session")
def browser(chromium_executable: str) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_executable, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class PageLog:
    """What a page did that a person would notice or that betrays a script: dialogs, console errors."""

    def __init__(self) -> None:
        self.dialogs: list[str] = []
        self.console_errors: list[str] = []
        self.page_errors: list[str] = []
        self.failed_requests: list[str] = []  # 4xx/5xx answers, but the favicon Chromium asks for unbidden


@pytest.fixture
def open_page(browser: Any, live_server: Any) -> Iterator[Callable[..., Any]]:
    """`open_page(user, *, bypass_csp=False) -> page` logged in as `user` (None: anonymous).

    The page has `.log` (a PageLog). With `bypass_csp=True` the Content-Security-Policy is off, so a test
    can check that escaping alone keeps hostile content from running."""
    from django.conf import settings
    from django.test import Client

    contexts = []

    def make(user: Any, *, bypass_csp: bool = False) -> Any:
        context = browser.new_context(base_url=live_server.url, bypass_csp=bypass_csp, viewport={"width": 1360, "height": 900})
        contexts.append(context)
        if user is not None:
            client = Client()
            client.force_login(user)
            cookie = client.cookies[settings.SESSION_COOKIE_NAME]
            context.add_cookies([{"name": cookie.key, "value": cookie.value, "url": live_server.url}])
        page = context.new_page()
        page.set_default_timeout(10_000)
        log = PageLog()
        page.on("dialog", lambda dialog: (log.dialogs.append(dialog.message), dialog.dismiss()))
        page.on(
            "console",
            lambda msg: log.console_errors.append(msg.text)
            if msg.type == "error" and not msg.text.startswith("Failed to load resource")
            else None,
        )
        page.on(
            "response",
            lambda r: log.failed_requests.append(f"{r.status} {r.url}")
            if r.status >= 400 and not r.url.endswith("/favicon.ico")
            else None,
        )
        page.on("pageerror", lambda exc: log.page_errors.append(str(exc)))
        page.log = log
        return page

    yield make
    for context in contexts:
        context.close()
