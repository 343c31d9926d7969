"""The payload corpus of the field in every field a trajectory carries, in tags, comments, an upload and a
project, crawled as a reviewer in Chromium with the Content-Security-Policy on.

On every page: nothing runs (no dialog, `window.__pwned` unset, no CSP violation, which would mean the
markup got through escaping and only the policy stopped it), no element the payloads describe exists, the
text reads as it was sent (`{{7*7}}` stays `{{7*7}}`), a right-to-left override (U+202E) left open in one
string does not reverse the id or label beside it, and the page never scrolls sideways, 1360 or 400 pixels
wide (long unbroken strings wrap or scroll in their own box)."""

from __future__ import annotations

import json
import urllib.request
from urllib.parse import urlencode

import pytest
from playwright.sync_api import expect

from flywheel.failures import review
from flywheel.trajectories.models import Trajectory, Upload
from flywheel.trajectories.presentation import pretty_json

# Each payload sets window.__pwned or opens a dialog if it ever runs.
CORPUS = {
    "script": "<script>window.__pwned='script'</script>",
    "img": "<img src=x onerror=\"window.__pwned='img';alert('img')\">",
    "svg": "<svg onload=\"window.__pwned='svg'\"><animate onbegin=alert('svg') attributeName=x dur=1s /></svg>",
    "javascript-url": "<a href=\"javascript:window.__pwned='link'\">click me</a> javascript:alert('url')",
    "attribute": "\"'><img src=x onerror=alert('attr')> ' onmouseover='alert(1)",
    "iframe": "<iframe srcdoc=\"<script>parent.__pwned='iframe'</script>\"></iframe>",
    "css": "</style><style>*{background:url(javascript:alert('css'))}</style><b style=\"width:expression(alert('css'))\">",
    "htmx": '<div hx-get="/" hx-trigger="load" hx-on::load="window.__pwned=\'htmx\'">hx</div>',
    "meta": '<meta http-equiv="refresh" content="0;url=javascript:alert(\'meta\')">',
    "template": "{{7*7}} {% debug %} ${alert('tpl')} #{7*7} <%= 7*7 %>",
    "entities": "&lt;script&gt;alert('entity')&lt;/script&gt; &amp;amp; &#x3C;img src=x onerror=alert(1)&#x3E;",
    "rtl": "\u202etxt.exe\u202c",
    "zero-width": "zero\u200bwidth\u200c\u200d\ufeffjoin",
}
PAYLOAD = " ".join(CORPUS.values())
LONG = "W" * 5000  # one word of 5,000 characters
FULL = f"{PAYLOAD} {LONG}"
TINY = "\"'><img src=x onerror=alert(1)>{{7*7}}\u202e"


def capped(n: int) -> str:
    """A payload for a field of at most `n` characters: markup, then an unbroken run to the cap."""
    return (TINY + "W" * n)[:n]


EXTERNAL_ID = capped(255)
AGENT = capped(200)
MODEL = capped(200)
TOOL = capped(200)
TAG = capped(64)
TAG_BY_HAND = "hand-" + capped(59)
CALL_ID = "call_" + FULL
ASKED = f"Hostile {TINY} {FULL}"  # the first user message: the title, with a right-to-left override left open


def hostile_record() -> dict:
    return {
        "external_id": EXTERNAL_ID,
        "agent": AGENT,
        "model_version": MODEL,
        "messages": [
            {"role": "system", "content": FULL},
            {"role": "user", "content": ASKED},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": FULL},
                    {"type": "image_url", "image_url": {"url": "javascript:alert('part')"}},
                    {"type": PAYLOAD, PAYLOAD: FULL},
                ],
            },
            {
                "role": "assistant",
                "content": FULL,
                "tool_calls": [
                    {
                        "id": CALL_ID,
                        "type": "function",
                        "function": {"name": TOOL, "arguments": json.dumps({PAYLOAD: FULL})},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": TOOL, "arguments": "not JSON " + FULL},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": CALL_ID, "name": FULL, "content": FULL},
            {"role": "tool", "tool_call_id": "call_2", "content": json.dumps({"error": FULL})},
            {"role": "assistant", "content": FULL, "refusal": FULL, PAYLOAD: {PAYLOAD: FULL}},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": TOOL,
                    "description": FULL,
                    "parameters": {
                        "type": "object",
                        "properties": {PAYLOAD: {"type": "string", "description": FULL}},
                    },
                },
            }
        ],
        "outcome": "failure",
        "feedback": {"comment": FULL, "rating": 1},
        "human_intervention": {"note": FULL, PAYLOAD: [FULL]},
        "latency_ms": 1830,
        "usage": {"cost": FULL},  # no token counts: shown as JSON
        "metadata": {PAYLOAD: FULL, "link": "javascript:alert('meta')", LONG: {"nested": [PAYLOAD]}},
        "started_at": "2026-12-01T10:00:00Z",
    }


# A CSP violation is what escaping let through and only the policy stopped: record each one.
CSP_LISTENER = """
window.__csp = [];
document.addEventListener('securitypolicyviolation',
  e => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI + ' ' + (e.sample || '')));
"""
# Elements and attributes the payloads describe; none of them is ever in our own markup.
INJECTED = (
    "iframe, object, embed, svg, animate, meta[http-equiv], style, [style*=expression], [onerror], [onload], [onbegin], "
    "[onmouseover], [hx-on\\:\\:load], [hx-trigger='load'], a[href^='javascript'], img[src='x']"
)


def reviewer_page(open_page, user):
    page = open_page(user)  # the CSP is on
    page.add_init_script(CSP_LISTENER)
    return page


WIDTHS = (1360, 400)  # the test's window, and a phone's


def assert_page_holds(page, where: str) -> None:
    """Nothing ran, nothing was injected, and the page does not scroll sideways, wide or narrow."""
    for width in WIDTHS[1:]:
        page.set_viewport_size({"width": width, "height": 900})
        assert_no_sideways_scroll(page, f"{where} at {width} px")
    page.set_viewport_size({"width": WIDTHS[0], "height": 900})
    state = page.evaluate(
        """() => ({
            pwned: window.__pwned ?? null,
            csp: window.__csp,
            scripts: [...document.scripts].map(s => s.getAttribute('src')),
        })"""
    )
    assert state["pwned"] is None, (where, state["pwned"])
    assert page.log.dialogs == [] and page.log.page_errors == [], (
        where,
        page.log.dialogs,
        page.log.page_errors,
    )
    assert state["csp"] == [] and page.log.console_errors == [], (
        where,
        state["csp"],
        page.log.console_errors,
    )
    assert all(src and src.startswith("/static/") for src in state["scripts"]), (where, state["scripts"])
    injected = page.eval_on_selector_all(INJECTED, "els => els.map(e => e.outerHTML.slice(0, 200))")
    assert injected == [], (where, injected)
    assert_no_sideways_scroll(page, where)


def assert_no_sideways_scroll(page, where: str) -> None:
    state = page.evaluate(
        """() => ({
            scrollWidth: document.documentElement.scrollWidth,
            innerWidth: window.innerWidth,
            wide: [...document.querySelectorAll('body *')]
                .filter(e => e.getBoundingClientRect().right > window.innerWidth + 1)
                .slice(0, 5).map(e => e.tagName + '.' + e.className + ' ' + (e.textContent || '').slice(0, 40)),
        })"""
    )
    assert state["scrollWidth"] <= state["innerWidth"], (where, state["scrollWidth"], state["wide"])


def text_of(page, selector: str) -> str:
    locator = page.locator(selector)
    expect(locator).to_be_visible()
    return locator.text_content()


def reads_left_to_right(page, selector: str) -> bool:
    """Whether the element's first characters are laid out left to right: a right-to-left override
    (U+202E) left open in the text before it must not reverse our own text after it."""
    return page.eval_on_selector(
        selector,
        """el => {
            const node = [...el.childNodes].find(n => n.nodeType === Node.TEXT_NODE && n.data.trim().length >= 4);
            const left = i => {
                const range = document.createRange();
                range.setStart(node, i);
                range.setEnd(node, i + 1);
                return range.getBoundingClientRect().left;
            };
            return left(0) < left(3);
        }""",
    )


def ingest_over_http(live_server, key: str, records: list[dict]) -> dict:
    request = urllib.request.Request(
        f"{live_server.url}/api/v1/trajectories",
        data=json.dumps(records).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture
def hostile(live_server, make_user, make_project, make_membership, make_api_key):
    """A project named with payloads, a hostile trajectory ingested through the API, tags and comments."""
    maintainer = make_user("maintainer")
    project = make_project("hostile", name=capped(200), owner=maintainer, description=FULL)
    reviewer = make_user("reviewer")
    make_membership(reviewer, project, "reviewer")
    key = make_api_key(project, name=capped(100))
    answer = ingest_over_http(live_server, key, [hostile_record()])
    assert answer["accepted"] == 1, answer
    trajectory = Trajectory.objects.get(project=project)
    review.trajectory_tag_add(trajectory=trajectory, name=TAG)
    review.trajectory_comment_add(trajectory=trajectory, author=reviewer, body=FULL, message_index=1)
    review.trajectory_comment_add(trajectory=trajectory, author=reviewer, body="On the whole: " + FULL)
    return project, trajectory, maintainer, reviewer


def test_the_list_and_its_filters(open_page, hostile):
    project, trajectory, _, reviewer = hostile
    page = reviewer_page(open_page, reviewer)
    base = f"/p/{project.slug}/"
    row = f"#row-{trajectory.id}"

    page.goto(base)
    assert text_of(page, f"{row} .title") == " ".join((ASKED).split())[:200]
    assert text_of(page, f"{row} .ext") == EXTERNAL_ID
    assert page.locator(f"{row} .c-agent").text_content() == AGENT
    assert page.locator(f"{row} .c-model").text_content() == MODEL
    assert page.locator(f"{row} .tag").text_content() == TAG
    assert reads_left_to_right(page, f"{row} .ext")  # after the title's open U+202E
    assert page.locator("header.topbar").text_content().count(project.name) == 1
    assert_page_holds(page, "list")

    # Payloads as filter values: echoed in the form, named where ignored, the filter still works.
    page.goto(base + "?" + urlencode({"agent": AGENT, "model_version": MODEL, "q": "onerror"}))
    expect(page.locator(row)).to_be_visible()
    assert page.get_by_label("Agent").input_value() == AGENT
    assert page.locator("#f-q").input_value() == "onerror"
    assert_page_holds(page, "list filtered by the payloads")

    junk = {"q": FULL, "outcome": PAYLOAD, "date_from": PAYLOAD, "date_to": LONG, "tool_error": PAYLOAD,
            "after": PAYLOAD, "agent": FULL}  # fmt: skip
    page.goto(base + "?" + urlencode(junk))
    assert FULL.startswith(page.locator("#f-q").input_value())
    expect(page.locator(".results .form-errors")).to_contain_text("<script>window.__pwned")
    assert_page_holds(page, "list with payloads as every filter")

    page.goto(base + "?" + urlencode({"q": PAYLOAD[:200]}))  # the text search finds it through the payload
    expect(page.locator(row)).to_be_visible()
    assert_page_holds(page, "list searched for the payload")


def test_the_trajectory_page(open_page, hostile, tmp_path):
    project, trajectory, _, reviewer = hostile
    page = reviewer_page(open_page, reviewer)
    page.goto(f"/p/{project.slug}/t/{trajectory.id}/?" + urlencode({"q": "onerror", "agent": AGENT}))
    assert_page_holds(page, "detail")
    page.screenshot(path=str(tmp_path / "detail.png"), full_page=False)

    assert text_of(page, ".t-title") == " ".join((ASKED).split())[:200]
    subhead = text_of(page, ".subhead")
    assert EXTERNAL_ID in subhead and AGENT in subhead and MODEL in subhead
    # Messages: string content, text parts, other parts, extra keys.
    assert text_of(page, "#m0 .content") == FULL
    assert text_of(page, "#m1 .content") == ASKED
    assert text_of(page, "#m2 .content") == FULL
    parts = page.locator("#m2 pre.json").all_text_contents()
    assert json.dumps(FULL, ensure_ascii=False) in "".join(parts) and "javascript:alert('part')" in "".join(
        parts
    )
    assert text_of(page, "#m6 .content") == FULL
    page.locator("#m6 .msg-details summary").click()
    assert json.dumps(FULL, ensure_ascii=False) in text_of(page, "#m6 .msg-details pre.json")
    # Tool calls, their arguments (valid JSON and not), results, names, ids.
    calls = page.locator("#m3 .toolcall")
    assert calls.nth(0).locator(".fn").text_content() == TOOL
    assert CALL_ID in calls.nth(0).locator(".call-head").text_content()
    assert json.dumps(FULL, ensure_ascii=False) in calls.nth(0).locator("pre.json").text_content()
    assert calls.nth(1).locator("pre.json").text_content() == "not JSON " + FULL
    assert text_of(page, "#m3 .content") == FULL
    assert text_of(page, "#m4 .content") == FULL
    head = text_of(page, "#m4 .msg-head")
    assert FULL in head and CALL_ID in head and TOOL in head
    assert text_of(page, "#m5 .content") == json.dumps({"error": FULL})
    # The side: feedback, human intervention, metadata (keys too), usage, declared tools, comments, tags.
    side = page.locator(".side")
    stored = Trajectory.objects.get(pk=trajectory.pk)
    for title, value in (("Feedback", stored.feedback), ("Human intervention", stored.human_intervention),
                         ("Metadata", stored.metadata), ("Usage", stored.usage)):  # fmt: skip
        panel = side.locator(".panel", has=page.locator("h2", has_text=title))
        expect(panel).to_be_visible()
        assert panel.locator("pre.json").text_content() == pretty_json(value), title
    assert (
        json.dumps(PAYLOAD, ensure_ascii=False) in side.locator(".panel", has_text="Metadata").text_content()
    )
    side.get_by_text("Tools declared").click()
    assert side.locator("details[open] pre.json").text_content() == pretty_json(stored.tools)
    assert text_of(page, "#comments-1 .comment .body") == FULL
    assert text_of(page, "#comments-t .comment .body") == "On the whole: " + FULL
    assert page.locator("#tags .tag").first.text_content().startswith(TAG)
    assert_page_holds(page, "detail, everything opened")

    # A reviewer writes payloads through the page's own forms (htmx swaps the answer in).
    message = page.locator("#m3")
    message.get_by_text("Comment on #3").click()
    message.get_by_role("textbox", name="Comment").fill(FULL)
    message.get_by_role("button", name="Add comment").click()
    expect(message.locator(".comment .body")).to_have_count(1)
    assert message.locator(".comment .body").text_content() == FULL
    page.get_by_role("combobox", name="Tag name").fill(TAG_BY_HAND)
    page.get_by_role("button", name="Tag", exact=True).click()
    expect(page.locator("#tags .tag")).to_have_count(2)
    assert TAG_BY_HAND in page.locator("#tags").text_content()
    message = page.locator("#m4")  # a comment too long: refused, and the form gives the text back
    message.get_by_text("Comment on #4").click()
    message.get_by_role("textbox", name="Comment").fill(FULL + FULL)
    message.get_by_role("button", name="Add comment").click()
    expect(message.locator(".field-error")).to_contain_text("at most")
    assert message.get_by_role("textbox", name="Comment").input_value() == FULL + FULL
    assert_page_holds(page, "detail after writing payloads")

    page.reload()
    assert page.locator("#m3 .comment .body").text_content() == FULL
    assert_page_holds(page, "detail reloaded")


def test_an_upload_with_rejected_lines_echoing_payloads(open_page, hostile):
    project, _, _, reviewer = hostile
    page = reviewer_page(open_page, reviewer)
    good = hostile_record() | {"external_id": "upload-" + capped(200)}
    lines = [
        json.dumps(good),
        json.dumps(
            {"external_id": EXTERNAL_ID, "messages": [{"role": "user", "content": FULL}], PAYLOAD: FULL}
        ),
        json.dumps(
            {
                "external_id": "bad-outcome-" + capped(100),
                "messages": [{"role": "user", "content": "x"}],
                "outcome": FULL,
            }
        ),  # fmt: skip
        "{" + FULL,  # not JSON
    ]
    filename = "<img src=x onerror=alert('file')>{{7*7}}\u202e" + "W" * 150 + ".jsonl"
    page.goto(f"/p/{project.slug}/upload/")
    page.locator("input[type=file]").set_input_files(
        {"name": filename, "mimeType": "application/x-ndjson", "buffer": "\n".join(lines).encode()}
    )
    page.get_by_role("button", name="Upload").click()
    expect(page.locator("[data-status=done]")).to_be_visible()
    upload = Upload.objects.get(project=project)
    assert (upload.accepted, upload.rejected_count) == (1, 3)
    assert text_of(page, ".upload-current h2") == upload.filename
    errors = page.locator(".upload-errors tbody")
    expect(errors).to_contain_text(EXTERNAL_ID)
    expect(errors).to_contain_text(PAYLOAD[:60])  # the unknown field is named: the payload itself
    assert_page_holds(page, "upload detail")

    page.goto(f"/p/{project.slug}/upload/")
    expect(page.locator(".trajectories a", has_text="onerror")).to_have_text(upload.filename)
    assert_page_holds(page, "upload list")


def test_settings_and_projects(open_page, hostile):
    project, _, maintainer, reviewer = hostile
    for user in (reviewer, maintainer):
        page = reviewer_page(open_page, user)
        page.goto(f"/p/{project.slug}/settings/")
        assert text_of(page, ".acc-head h1").startswith(project.name)
        assert text_of(page, ".acc-head p") == FULL
        assert reads_left_to_right(page, ".acc-head h1 .mono")  # the slug, after the name's open U+202E
        if user == maintainer:
            assert text_of(page, "#api-keys tbody td:first-child") == capped(100)
        assert_page_holds(page, f"settings as {user.username}")

        page.goto("/")
        assert text_of(page, "#projects td:first-child a") == project.name
        assert_page_holds(page, f"projects as {user.username}")
