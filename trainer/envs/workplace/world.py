"""Seeded companies for the workplace: who works there, their projects, tasks, calendar and mail.

Titles (of tasks, events, emails) are what make a request unique, so they carry the train/holdout split:
a title belongs to exactly one split, by a hash of its text, and a company only uses its split's titles.
No holdout request can then equal, or be one word away from, a train request about the same thing.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

SPLITS = ("train", "holdout")
HOLDOUT_FRACTION = 0.25
TODAY = "2026-03-02"

PEOPLE = [
    ("alice", "Alice Smith", "eng"),
    ("bob", "Bob Jones", "eng"),
    ("carol", "Carol Diaz", "design"),
    ("dave", "Dave Kim", "sales"),
    ("erin", "Erin Patel", "ops"),
    ("frank", "Frank Moore", "eng"),
    ("grace", "Grace Lee", "design"),
    ("heidi", "Heidi Chen", "sales"),
    ("ivan", "Ivan Novak", "ops"),
    ("judy", "Judy Brown", "eng"),
    ("kevin", "Kevin Wu", "sales"),
    ("laura", "Laura Garcia", "design"),
    ("mike", "Mike Ross", "ops"),
    ("nina", "Nina Khan", "eng"),
    ("oscar", "Oscar Silva", "design"),
    ("peggy", "Peggy Olsen", "sales"),
]
PROJECTS = ["Apollo", "Borealis", "Cobalt", "Delta", "Ember", "Falcon", "Granite", "Harbor"]
TASK_VERBS = ["Fix", "Update", "Review", "Draft", "Test", "Plan", "Write", "Ship", "Design", "Audit"]
TASK_OBJECTS = [
    "login page", "pricing doc", "release notes", "onboarding flow", "api docs", "billing bug", "dashboard",
    "test suite", "roadmap", "budget sheet", "search index", "style guide", "mobile app", "status page",
]  # fmt: skip
EVENT_KINDS = [
    "design review", "sprint planning", "budget sync", "customer call", "retro", "roadmap review",
    "hiring panel", "launch prep", "security review", "demo",
]  # fmt: skip
DATES = [f"2026-03-{d:02d}" for d in range(3, 28)]
TIMES = ["09:00", "10:00", "11:30", "13:00", "14:00", "15:30", "16:00"]


def split_of(title: str) -> str:
    """The split a title belongs to: a stable hash, the same on every machine and Python run."""
    digest = hashlib.sha256(("flywheel-workplace:" + title.casefold()).encode()).digest()
    return "holdout" if digest[0] < 256 * HOLDOUT_FRACTION else "train"


def _pool(titles: list[str]) -> dict[str, list[str]]:
    pools: dict[str, list[str]] = {s: [] for s in SPLITS}
    for title in titles:
        pools[split_of(title)].append(title)
    return pools


TASK_TITLES = _pool([f"{v} {o}" for v in TASK_VERBS for o in TASK_OBJECTS])
EVENT_TITLES = _pool([f"{p} {k}" for p in PROJECTS for k in EVENT_KINDS])


def make_world(rng: random.Random, split: str) -> dict[str, Any]:
    """A small company (5 people, 3 projects, 5 tasks, 3 events, 2 emails): short observations, real choices."""
    people = rng.sample(PEOPLE, 5)
    ids = [p[0] for p in people]
    projects = rng.sample(PROJECTS, 3)
    titles = rng.sample(TASK_TITLES[split], 7)
    events = rng.sample(EVENT_TITLES[split], 3)
    return {
        "today": TODAY,
        "people": [{"id": i, "name": n, "email": f"{i}@acme.test", "team": t} for i, n, t in people],
        "projects": [
            {"id": p.lower(), "name": p, "owner": rng.choice(ids), "status": "active"} for p in projects
        ],
        "tasks": [
            {
                "id": f"T{k + 1}",
                "title": titles[k],
                "project": rng.choice(projects).lower(),
                "assignee": rng.choice(ids),
                "status": rng.choice(["open", "open", "in_progress", "done"]),
                "due": rng.choice(DATES),
                "priority": rng.choice(["low", "normal", "normal", "high"]),
            }
            for k in range(5)
        ],
        "events": [
            {
                "id": f"E{k + 1}",
                "title": events[k],
                "date": rng.choice(DATES),
                "time": rng.choice(TIMES),
                "attendees": sorted(rng.sample(ids, 2)),
                "status": "scheduled",
            }
            for k in range(3)
        ],
        "emails": [
            {
                "id": f"M{k + 1}",
                "from": rng.choice(ids),
                "to": ["me"],
                "subject": titles[5 + k],
                "body": "",
                "folder": "inbox",
            }
            for k in range(2)
        ],
    }
