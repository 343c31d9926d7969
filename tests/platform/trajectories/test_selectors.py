"""Selectors of the review pages: each filter, keyset pagination at page boundaries, capped counts,
neighbours for j/k, the conversation view, and (on PostgreSQL) that every list query is an index scan."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from django.db import connection

from flywheel.failures import review
from flywheel.trajectories import presentation, selectors
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory
from flywheel.trajectories.selectors import TrajectoryFilters as F


def trajectory_record(external_id: str, **overrides):
    """A valid record as an agent sends it: system, user, a tool call, its result, the answer."""
    record = {
        "external_id": external_id,
        "agent": "support-bot",
        "model_version": "qwen-0.5b-v3",
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
            {"role": "tool", "tool_call_id": "call_1", "content": '{"status": "shipped"}'},
            {"role": "assistant", "content": "Your order has shipped."},
        ],
        "tools": [{"type": "function", "function": {"name": "get_order", "parameters": {"type": "object"}}}],
        "outcome": "success",
        "latency_ms": 812,
        "usage": {"prompt_tokens": 120, "completion_tokens": 30},
        "metadata": {"region": "eu"},
        "started_at": "2026-12-01T10:00:00Z",
    }
    record.update(overrides)
    return record


def ingest(project, *records):
    result = ingest_trajectories(project=project, records=list(records))
    assert not result.rejected, result.rejected
    ids = dict(Trajectory.objects.filter(project=project).values_list("external_id", "id"))
    return [ids[r["external_id"]] for r in records]


def tool_error_record(external_id, **overrides):
    record = trajectory_record(external_id, **overrides)
    record["messages"][3]["content"] = "Error: order service timed out"
    return record


def page_ids(page):
    return [t.id for t in page.rows]


@pytest.fixture
def sample(project):
    """Six trajectories in `project`, plus one in another project that must never show."""
    from flywheel.accounts.services import project_create

    other = project_create(slug="other-project")
    ingest(other, trajectory_record("elsewhere", outcome="failure"))
    ids = ingest(
        project,
        trajectory_record("a", agent="billing", outcome="success", started_at="2026-11-01T08:00:00Z"),
        trajectory_record("b", agent="billing", outcome="failure", started_at="2026-11-02T23:59:00Z"),
        tool_error_record("c", agent="support", outcome="failure", model_version="v2", started_at="2026-11-03T00:00:00Z"),
        trajectory_record("d", agent="support", outcome="unknown", model_version="v2", started_at="2026-11-04T12:00:00Z"),
        trajectory_record(
            "e",
            messages=[{"role": "user", "content": "Refund the DOUBLE charge please"}, {"role": "assistant", "content": "Done."}],
            outcome="success",
        ),
        tool_error_record("f", outcome="unknown"),
    )
    return dict(zip("abcdef", ids, strict=True))


def matching(project, **filters):
    qs = selectors.trajectory_queryset(project=project, filters=F(**filters))
    return sorted(qs.values_list("external_id", flat=True))


@pytest.mark.django_db
def test_each_filter(project, sample):
    assert matching(project) == list("abcdef")
    assert matching(project, outcome="failure") == ["b", "c"]
    assert matching(project, agent="billing") == ["a", "b"]
    assert matching(project, model_version="v2") == ["c", "d"]
    assert matching(project, tool_error=True) == ["c", "f"]
    assert matching(project, tool_error=False) == ["a", "b", "d", "e"]
    assert matching(project, q="double CHARGE") == ["e"]  # case-insensitive, across words
    assert matching(project, q="100%") == []  # LIKE wildcards are literal
    assert matching(project, agent="support", outcome="failure", tool_error=True) == ["c"]


@pytest.mark.django_db
def test_date_range_is_inclusive_of_whole_days(project, sample):
    day = dt.date.fromisoformat
    assert matching(project, date_from=day("2026-11-02"), date_to=day("2026-11-03")) == ["b", "c"]
    assert matching(project, date_from=day("2026-11-04")) == ["d", "e", "f"]  # e, f: the factory's Dec 1
    assert matching(project, date_to=day("2026-11-01")) == ["a"]


@pytest.mark.django_db
def test_the_date_range_finds_a_trajectory_sent_without_started_at(project):
    record = trajectory_record("no-start")
    del record["started_at"]
    ingest(project, record)
    today = Trajectory.objects.get(external_id="no-start").created_at.date()
    assert matching(project, date_from=today, date_to=today) == ["no-start"]


@pytest.mark.django_db
def test_outcome_filter_uses_the_reviewed_outcome(project, sample, user):
    review.trajectory_outcome_set(trajectory=Trajectory.objects.get(pk=sample["a"]), outcome="failure", user=user)
    assert matching(project, outcome="failure") == ["a", "b", "c"]
    assert "a" not in matching(project, outcome="success")


def test_params_round_trip_and_report_bad_values():
    filters = F.from_params(
        {"outcome": "failure", "agent": " billing ", "date_from": "2026-11-02", "tool_error": "yes", "q": "refund"}
    )
    assert filters == F(outcome="failure", agent="billing", date_from=dt.date(2026, 11, 2), tool_error=True, q="refund")
    assert F.from_params(filters.params()) == filters
    bad = F.from_params({"outcome": "great", "date_to": "yesterday"})
    assert bad == F() and len(bad.errors) == 2
    assert "yesterday" in bad.errors[1]


@pytest.mark.django_db
def test_keyset_pages_meet_exactly_at_the_boundaries(project):
    ids = ingest(project, *[trajectory_record(f"t{i}") for i in range(7)])
    newest_first = sorted(ids, reverse=True)
    everything = F()

    first = selectors.trajectory_page(project=project, filters=everything, size=3)
    assert page_ids(first) == newest_first[:3]
    assert first.prev_cursor is None and first.next_cursor == newest_first[2]

    second = selectors.trajectory_page(project=project, filters=everything, after=first.next_cursor, size=3)
    assert page_ids(second) == newest_first[3:6]
    assert second.prev_cursor == newest_first[3] and second.next_cursor == newest_first[5]

    last = selectors.trajectory_page(project=project, filters=everything, after=second.next_cursor, size=3)
    assert page_ids(last) == newest_first[6:]
    assert last.next_cursor is None and last.prev_cursor == newest_first[6]

    # Back from the last page lands on exactly the second page, and from there on the first.
    back = selectors.trajectory_page(project=project, filters=everything, before=last.prev_cursor, size=3)
    assert page_ids(back) == page_ids(second) and back.prev_cursor == newest_first[3]
    back = selectors.trajectory_page(project=project, filters=everything, before=back.prev_cursor, size=3)
    assert page_ids(back) == page_ids(first) and back.prev_cursor is None


@pytest.mark.django_db
def test_keyset_exact_multiple_has_no_empty_last_page(project):
    ids = ingest(project, *[trajectory_record(f"t{i}") for i in range(6)])
    first = selectors.trajectory_page(project=project, filters=F(), size=3)
    second = selectors.trajectory_page(project=project, filters=F(), after=first.next_cursor, size=3)
    assert page_ids(second) == sorted(ids, reverse=True)[3:]
    assert second.next_cursor is None


@pytest.mark.django_db
def test_keyset_pages_are_stable_while_new_trajectories_arrive(project):
    ingest(project, *[trajectory_record(f"t{i}") for i in range(5)])
    first = selectors.trajectory_page(project=project, filters=F(), size=2)
    expected = page_ids(selectors.trajectory_page(project=project, filters=F(), after=first.next_cursor, size=2))
    ingest(project, trajectory_record("new-1"), trajectory_record("new-2"))
    again = selectors.trajectory_page(project=project, filters=F(), after=first.next_cursor, size=2)
    assert page_ids(again) == expected  # OFFSET would have shifted by two


@pytest.mark.django_db
def test_keyset_with_a_filter_walks_every_match_once(project):
    records = [trajectory_record(f"t{i}", outcome="failure" if i % 3 else "success") for i in range(20)]
    ingest(project, *records)
    filters = F(outcome="failure")
    seen, cursor = [], None
    while True:
        page = selectors.trajectory_page(project=project, filters=filters, after=cursor, size=4)
        seen += page_ids(page)
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    expected = list(
        Trajectory.objects.filter(project=project, outcome="failure").order_by("-id").values_list("id", flat=True)
    )
    assert seen == expected and len(expected) == 13


@pytest.mark.django_db
def test_page_rows_carry_their_tags(project, sample):
    trajectory = Trajectory.objects.get(pk=sample["f"])
    review.trajectory_tag_add(trajectory=trajectory, name="wrong-tool")
    review.trajectory_tag_add(trajectory=trajectory, name="billing")
    rows = {t.id: t for t in selectors.trajectory_page(project=project, filters=F()).rows}
    assert rows[sample["f"]].tag_names == ["billing", "wrong-tool"]
    assert rows[sample["a"]].tag_names == []


@pytest.mark.django_db
def test_counts_per_outcome_ignore_the_outcome_filter_and_stop_at_the_cap(project, sample):
    counts = {c.label: c for c in selectors.trajectory_outcome_counts(project=project, filters=F(outcome="failure"))}
    assert {k: c.count for k, c in counts.items()} == {"All": 6, "Success": 2, "Failure": 2, "Unknown": 2}
    assert not any(c.capped for c in counts.values())

    narrowed = selectors.trajectory_outcome_counts(project=project, filters=F(agent="billing"))
    assert [(c.label, c.count) for c in narrowed] == [("All", 2), ("Success", 1), ("Failure", 1), ("Unknown", 0)]

    capped = {c.label: c for c in selectors.trajectory_outcome_counts(project=project, filters=F(), cap=1)}
    assert capped["Failure"].capped and capped["Failure"].display == "1+"
    assert capped["All"].capped and capped["All"].display == "3+"


@pytest.mark.django_db
def test_neighbours_stay_within_the_filter(project, sample):
    failures = F(outcome="failure")
    assert selectors.trajectory_neighbours(project=project, filters=failures, trajectory_id=sample["b"]) == (
        sample["c"],
        None,
    )
    assert selectors.trajectory_neighbours(project=project, filters=F(), trajectory_id=sample["c"]) == (
        sample["d"],
        sample["b"],
    )


@pytest.mark.django_db
def test_filter_options_are_the_distinct_values(project, sample):
    assert selectors.trajectory_filter_options(project=project, column="agent") == ["billing", "support", "support-bot"]
    assert selectors.trajectory_filter_options(project=project, column="model_version") == ["qwen-0.5b-v3", "v2"]
    with pytest.raises(ValueError):
        selectors.trajectory_filter_options(project=project, column="search_text")


@pytest.mark.django_db
def test_conversation_links_results_to_calls_and_flags_errors(project):
    record = trajectory_record("conv")
    record["messages"][2]["tool_calls"].append(
        {"id": "call_2", "type": "function", "function": {"name": "drop_tables", "arguments": "{not json"}}
    )
    record["messages"].insert(4, {"role": "tool", "tool_call_id": "call_2", "content": "Traceback: boom"})
    record["messages"][1]["content"] = [{"type": "text", "text": "hello"}, {"type": "image_url", "image_url": {"url": "x"}}]
    (trajectory_id,) = ingest(project, record)
    views = presentation.conversation_build(trajectory=Trajectory.objects.get(pk=trajectory_id))

    assert [v.role for v in views] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert views[1].text == "hello" and "image_url" in views[1].extra_parts[0]
    good, bad = views[2].tool_calls
    assert good.arguments == json.dumps({"order_id": "1234"}, indent=2) and good.arguments_valid and good.known_tool
    assert good.result_anchor == "m3" and views[3].call_anchor == good.anchor and views[3].call_name == "get_order"
    assert not bad.arguments_valid and bad.arguments == "{not json" and not bad.known_tool
    assert views[4].call_anchor == bad.anchor and views[4].is_error and not views[3].is_error


# --- query plans ---------------------------------------------------------------------------------------

PLANNED = {
    "newest": F(),
    "outcome": F(outcome="failure"),
    "agent": F(agent="billing"),
    "model": F(model_version="v2"),
    "tool_error": F(tool_error=True),
    "dates": F(date_from=dt.date(2026, 11, 2), date_to=dt.date(2026, 11, 3)),
    "text": F(q="double charge"),
    "combined": F(outcome="failure", agent="support", tool_error=True),
}


def plan(qs) -> str:
    sql, params = qs.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cursor.fetchall())


@pytest.mark.parametrize("name", list(PLANNED))
def test_every_list_query_is_an_index_scan_on_postgresql(needs_postgres, project, sample, name):
    """With sequential scans priced out, a query that no index can answer still shows a Seq Scan."""
    filters = PLANNED[name]
    base = selectors.trajectory_queryset(project=project, filters=filters)
    queries = [
        base.only(*selectors.LIST_FIELDS).order_by("-id")[:51],
        base.filter(id__lt=sample["d"]).order_by("-id")[:51],
        base.alias(effective=selectors.EFFECTIVE_OUTCOME).filter(effective="failure").values("id")[:10_001],
    ]
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
    for qs in queries:
        text = plan(qs)
        assert "Seq Scan" not in text, text


def test_text_search_can_use_the_trigram_index_on_postgresql(needs_postgres, project, sample):
    """The lookup the selector emits (`search_text::text LIKE …`) must match the GIN index expression."""
    # Across projects, so that the trigram index is the only one that can narrow the search.
    qs = Trajectory.objects.filter(search_text__contains="double charge")
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
    text = plan(qs)
    assert "traj_search_trgm" in text, text


def test_effective_outcome_filter_matches_its_index_on_postgresql(needs_postgres, project, sample):
    """The selector's expression must be the index's, or the planner cannot use it (tiny tables: checked
    across projects, where only this index narrows; bench/pages.py shows the plans at a million rows)."""
    qs = (
        Trajectory.objects.alias(effective=selectors.EFFECTIVE_OUTCOME)
        .filter(effective="failure")
        .values("id")[:10_001]
    )
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("SET LOCAL enable_bitmapscan = off")
    text = plan(qs)
    assert "using traj_project_effoutcome_id" in text, text


@pytest.mark.django_db
def test_filtered_counts_past_the_cap_are_lower_bounds(project, sample):
    counts = {c.label: c for c in selectors.trajectory_outcome_counts(project=project, filters=F(tool_error=False), cap=2)}
    assert counts["All"].display == "2+"
    assert all(c.capped for c in counts.values())
    assert sum(c.count for c in counts.values() if c.label != "All") == 3


def test_counts_that_run_out_of_time_are_left_blank(needs_postgres, project, sample, monkeypatch):
    def slow(base, cap):
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_sleep(0.2)")
        return {}

    monkeypatch.setattr(selectors, "_grouped_sample", slow)
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('statement_timeout'), current_setting('enable_seqscan')")
        before = cursor.fetchone()
    counts = selectors.trajectory_outcome_counts(project=project, filters=F(agent="billing"), budget_ms=20)
    assert [c.count for c in counts] == [None] * 4 and counts[0].display == ""
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('statement_timeout'), current_setting('enable_seqscan')")
        assert cursor.fetchone() == before  # the budget does not leak into later statements
        cursor.execute("SELECT 1")


@pytest.mark.django_db
@pytest.mark.parametrize("filters", [F(), F(outcome="failure"), F(date_to=dt.date(2026, 12, 31)), F(q="order")])
def test_both_read_paths_give_the_same_pages(project, filters):
    """The id walk and the filter-index path (sparse matches, an end date) page identically."""
    ingest(project, *[trajectory_record(f"t{i}", outcome="failure" if i % 2 else "success") for i in range(9)])

    def walk(sparse):
        seen, cursor = [], None
        while True:
            page = selectors.trajectory_page(project=project, filters=filters, after=cursor, size=2, sparse=sparse)
            seen.append(page_ids(page))
            if page.next_cursor is None:
                return seen
            cursor = page.next_cursor

    assert walk(True) == walk(False)
    back = selectors.trajectory_page(project=project, filters=filters, before=walk(False)[-1][0], size=2, sparse=True)
    assert page_ids(back) == walk(False)[-2]


@pytest.mark.django_db
def test_neighbours_fall_back_to_the_filter_index_past_the_budget(project, sample, monkeypatch):
    import contextlib

    from django.db import OperationalError

    class Cancelled(Exception):
        sqlstate = "57014"

    @contextlib.contextmanager
    def always_cancelled(ms):
        try:
            raise Cancelled()
        except Cancelled as cause:
            raise OperationalError("canceling statement due to statement timeout") from cause
        yield  # pragma: no cover

    monkeypatch.setattr(selectors, "_time_budget", always_cancelled)
    assert selectors.trajectory_neighbours(project=project, filters=F(), trajectory_id=sample["c"]) == (
        sample["d"],
        sample["b"],
    )


# --- query strings never fail: unusable values are left out and named ------------------------------------


@pytest.mark.django_db
def test_the_last_day_there_is_as_an_end_date_is_no_bound(project, sample):
    # date_to + 1 day overflowed (OverflowError, a 500 on every page that filters).
    filters = F.from_params({"date_to": "9999-12-31"})
    assert filters.date_to == dt.date.max and not filters.errors
    assert matching(project, date_to=dt.date.max) == list("abcdef")
    assert matching(project, date_from=dt.date.min, date_to=dt.date.max) == list("abcdef")


@pytest.mark.parametrize(
    ("params", "note"),
    [
        ({"agent": "bot\x00"}, "Ignored agent 'bot\\x00': it contains a NUL character."),
        ({"model_version": "\x00"}, "Ignored model version '\\x00': it contains a NUL character."),
        ({"q": "a\x00b"}, "Ignored text search 'a\\x00b': it contains a NUL character."),
        ({"agent": "a" * 201}, "it is longer than 200 characters"),
        ({"outcome": "great"}, "Ignored outcome 'great': not one of success, failure, unknown."),
        ({"date_to": "yesterday"}, "Ignored To date 'yesterday': it is not a date (YYYY-MM-DD)."),
    ],
)
def test_unusable_filter_values_are_left_out_and_named(params, note):
    filters = F.from_params(params)
    assert filters == F()
    assert len(filters.errors) == 1 and note in filters.errors[0]


def test_a_long_text_search_is_cut_and_says_so():
    filters = F.from_params({"q": "x" * 500})
    assert filters.q == "x" * selectors.MAX_SEARCH_CHARS
    assert filters.errors == ("The text search was cut to its first 200 characters.",)


@pytest.mark.parametrize("raw", ["²", "١٢", "-3", "1.5", "9" * 20, "0x10"])
def test_a_cursor_is_ascii_digits_or_it_is_left_out(raw):
    # "²".isdigit() is True but int("²") raises: the page answered 500.
    cursor = selectors.PageCursor.from_params({"after": raw, "before": raw})
    assert (cursor.after, cursor.before) == (None, None)
    assert [e.split(" ")[1] for e in cursor.errors] == ["after", "before"]
    assert "is not a page cursor" in cursor.errors[0]
    ok = selectors.PageCursor.from_params({"after": " 42 "})
    assert (ok.after, ok.before, ok.errors, ok.params()) == (42, None, (), {"after": 42})
