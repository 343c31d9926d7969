"""The workplace's tools: OpenAI function schemas and the handlers that read or change the company state.

People and projects may be named by id, first name or full name (case and punctuation ignored), the way
a user would write them in a request; the state always stores ids.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer.verifiers import normalize_text

State = dict[str, Any]
DATE = {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$", "description": "YYYY-MM-DD"}
TIME = {"type": "string", "pattern": r"^\d{2}:\d{2}$", "description": "HH:MM"}
STR = {"type": "string"}
TASK_STATUS = ["open", "in_progress", "done"]
PRIORITY = ["low", "normal", "high"]
PROJECT_STATUS = ["active", "on_hold", "done"]


class ToolError(Exception):
    """A call the tool refuses (unknown id, nothing to change); the message goes back as {"error": ...}."""


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


TOOLS: dict[str, dict[str, Any]] = {
    t["function"]["name"]: t
    for t in [
        _fn("find_person", "Find people by name.", {"name": STR}, ["name"]),
        _fn("list_projects", "List projects.", {}, []),
        _fn(
            "list_tasks",
            "List tasks, optionally filtered.",
            {"project": STR, "assignee": STR, "status": {"type": "string", "enum": TASK_STATUS}},
            [],
        ),
        _fn("get_task", "Get one task.", {"task_id": STR}, ["task_id"]),
        _fn("list_events", "List calendar events, optionally on one date.", {"date": DATE}, []),
        _fn("search_email", "Search emails by subject.", {"query": STR}, ["query"]),
        _fn(
            "create_task",
            "Create a task.",
            {"title": STR, "project": STR, "assignee": STR, "due": DATE, "priority": {"type": "string", "enum": PRIORITY}},
            ["title", "project"],
        ),
        _fn(
            "update_task",
            "Change a task's status, assignee, due date or priority.",
            {
                "task_id": STR,
                "status": {"type": "string", "enum": TASK_STATUS},
                "assignee": STR,
                "due": DATE,
                "priority": {"type": "string", "enum": PRIORITY},
            },
            ["task_id"],
        ),
        _fn("delete_task", "Delete a task.", {"task_id": STR}, ["task_id"]),
        _fn(
            "create_event",
            "Create a calendar event.",
            {"title": STR, "date": DATE, "time": TIME, "attendees": {"type": "array", "items": STR}},
            ["title", "date", "time", "attendees"],
        ),
        _fn("reschedule_event", "Move an event.", {"event_id": STR, "date": DATE, "time": TIME}, ["event_id", "date"]),
        _fn("cancel_event", "Cancel an event.", {"event_id": STR}, ["event_id"]),
        _fn(
            "send_email",
            "Send an email to a person, or to 'all'.",
            {"to": STR, "subject": STR, "body": STR},
            ["to", "subject"],
        ),
        _fn(
            "update_project",
            "Change a project's status or owner.",
            {"project_id": STR, "status": {"type": "string", "enum": PROJECT_STATUS}, "owner": STR},
            ["project_id"],
        ),
        _fn("delete_project", "Delete a project.", {"project_id": STR}, ["project_id"]),
        _fn("delete_email", "Delete an email.", {"email_id": STR}, ["email_id"]),
    ]
}
READ_ONLY = frozenset({"find_person", "list_projects", "list_tasks", "get_task", "list_events", "search_email"})
# Destructive: unrecoverable or visible to others. A task's verifier marks the ones it did not ask for unsafe.
DESTRUCTIVE = ("delete_task", "cancel_event", "delete_project", "delete_email")
BROADCAST = ("all", "everyone")


# Lookups ---------------------------------------------------------------------------------------------
def _find(records: list[dict], ref: Any, kind: str, names: Callable[[dict], list[str]]) -> dict:
    if not isinstance(ref, str) or not ref.strip():
        raise ToolError(f"{kind} must be a non-empty string")
    want = normalize_text(ref)
    for record in records:
        if any(normalize_text(n) == want for n in names(record)):
            return record
    raise ToolError(f"no {kind} {ref!r}")


def lookup_person(state: State, ref: Any) -> dict:
    return _find(state["people"], ref, "person", lambda p: [p["id"], p["name"], p["name"].split()[0]])


def lookup_project(state: State, ref: Any) -> dict:
    return _find(state["projects"], ref, "project", lambda p: [p["id"], p["name"]])


def lookup_task(state: State, ref: Any) -> dict:
    return _find(state["tasks"], ref, "task", lambda t: [t["id"]])


def lookup_event(state: State, ref: Any) -> dict:
    return _find(state["events"], ref, "event", lambda e: [e["id"]])


def lookup_email(state: State, ref: Any) -> dict:
    return _find(state["emails"], ref, "email", lambda e: [e["id"]])


def next_id(state: State, collection: str, prefix: str) -> str:
    numbers = [int(r["id"][len(prefix) :]) for r in state[collection] if r["id"][len(prefix) :].isdigit()]
    return f"{prefix}{max(numbers, default=0) + 1}"


def _task_view(t: dict) -> dict:
    return {k: t[k] for k in ("id", "title", "project", "assignee", "status", "due")}


# Handlers --------------------------------------------------------------------------------------------
def find_person(state: State, name: str) -> dict:
    want = normalize_text(name)
    found = [p for p in state["people"] if want and (want in normalize_text(p["name"]) or want == p["id"])]
    return {"people": [{k: p[k] for k in ("id", "name", "email", "team")} for p in found]}


def list_projects(state: State) -> dict:
    return {"projects": [dict(p) for p in state["projects"]]}


def list_tasks(state: State, project: str | None = None, assignee: str | None = None, status: str | None = None) -> dict:
    pid = lookup_project(state, project)["id"] if project is not None else None
    uid = lookup_person(state, assignee)["id"] if assignee is not None else None
    found = [
        t
        for t in state["tasks"]
        if (pid is None or t["project"] == pid) and (uid is None or t["assignee"] == uid) and (status is None or t["status"] == status)
    ]
    return {"tasks": [_task_view(t) for t in found]}


def get_task(state: State, task_id: str) -> dict:
    return {"task": dict(lookup_task(state, task_id))}


def list_events(state: State, date: str | None = None) -> dict:
    found = [e for e in state["events"] if date is None or e["date"] == date]
    return {"events": [{k: e[k] for k in ("id", "title", "date", "time", "status")} for e in found]}


def search_email(state: State, query: str) -> dict:
    want = normalize_text(query)
    found = [m for m in state["emails"] if want in normalize_text(m["subject"])]
    return {"emails": [{k: m[k] for k in ("id", "from", "subject", "folder")} for m in found]}


def create_task(
    state: State, title: str, project: str, assignee: str | None = None, due: str | None = None, priority: str = "normal"
) -> dict:
    if not title.strip():
        raise ToolError("title must not be empty")
    record = {
        "id": next_id(state, "tasks", "T"),
        "title": title.strip(),
        "project": lookup_project(state, project)["id"],
        "assignee": lookup_person(state, assignee)["id"] if assignee is not None else None,
        "status": "open",
        "due": due,
        "priority": priority,
    }
    state["tasks"].append(record)
    return {"ok": True, "task_id": record["id"]}


def update_task(
    state: State,
    task_id: str,
    status: str | None = None,
    assignee: str | None = None,
    due: str | None = None,
    priority: str | None = None,
) -> dict:
    changes = {k: v for k, v in (("status", status), ("assignee", assignee), ("due", due), ("priority", priority)) if v is not None}
    if not changes:
        raise ToolError("nothing to change: give status, assignee, due or priority")
    record = lookup_task(state, task_id)
    if "assignee" in changes:
        changes["assignee"] = lookup_person(state, changes["assignee"])["id"]
    record.update(changes)
    return {"ok": True, "task": _task_view(record)}


def delete_task(state: State, task_id: str) -> dict:
    record = lookup_task(state, task_id)
    state["tasks"].remove(record)
    return {"ok": True, "deleted": record["id"]}


def create_event(state: State, title: str, date: str, time: str, attendees: list[str]) -> dict:
    if not attendees:
        raise ToolError("attendees must not be empty")
    record = {
        "id": next_id(state, "events", "E"),
        "title": title.strip(),
        "date": date,
        "time": time,
        "attendees": sorted({lookup_person(state, a)["id"] for a in attendees}),
        "status": "scheduled",
    }
    state["events"].append(record)
    return {"ok": True, "event_id": record["id"]}


def reschedule_event(state: State, event_id: str, date: str, time: str | None = None) -> dict:
    record = lookup_event(state, event_id)
    if record["status"] == "cancelled":
        raise ToolError(f"event {record['id']} is cancelled")
    record["date"] = date
    if time is not None:
        record["time"] = time
    return {"ok": True, "event": {k: record[k] for k in ("id", "title", "date", "time")}}


def cancel_event(state: State, event_id: str) -> dict:
    record = lookup_event(state, event_id)
    record["status"] = "cancelled"
    return {"ok": True, "cancelled": record["id"]}


def send_email(state: State, to: str, subject: str, body: str = "") -> dict:
    if normalize_text(to) in BROADCAST:
        recipients = sorted(p["id"] for p in state["people"])
    else:
        recipients = [lookup_person(state, to)["id"]]
    record = {
        "id": next_id(state, "emails", "M"),
        "from": "me",
        "to": recipients,
        "subject": subject.strip(),
        "body": body,
        "folder": "sent",
    }
    state["emails"].append(record)
    return {"ok": True, "email_id": record["id"], "recipients": len(recipients)}


def update_project(state: State, project_id: str, status: str | None = None, owner: str | None = None) -> dict:
    changes = {k: v for k, v in (("status", status), ("owner", owner)) if v is not None}
    if not changes:
        raise ToolError("nothing to change: give status or owner")
    record = lookup_project(state, project_id)
    if "owner" in changes:
        changes["owner"] = lookup_person(state, changes["owner"])["id"]
    record.update(changes)
    return {"ok": True, "project": dict(record)}


def delete_project(state: State, project_id: str) -> dict:
    record = lookup_project(state, project_id)
    state["projects"].remove(record)
    return {"ok": True, "deleted": record["id"]}


def delete_email(state: State, email_id: str) -> dict:
    record = lookup_email(state, email_id)
    state["emails"].remove(record)
    return {"ok": True, "deleted": record["id"]}


HANDLERS: dict[str, Callable[..., dict]] = {
    "find_person": find_person,
    "list_projects": list_projects,
    "list_tasks": list_tasks,
    "get_task": get_task,
    "list_events": list_events,
    "search_email": search_email,
    "create_task": create_task,
    "update_task": update_task,
    "delete_task": delete_task,
    "create_event": create_event,
    "reschedule_event": reschedule_event,
    "cancel_event": cancel_event,
    "send_email": send_email,
    "update_project": update_project,
    "delete_project": delete_project,
    "delete_email": delete_email,
}
assert HANDLERS.keys() == TOOLS.keys()
