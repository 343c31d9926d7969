"""The demo `make run` seeds: an admin login, a demo project with an API key, and a dozen tool-calling
conversations of a support agent, successes and the failures Flywheel is for (wrong tool, bad arguments,
tool errors, an unsafe action, an invented tool); and the loop's own demo project, whose tiny model the
worker builds and registers, then plays to make its trajectories, task set and suites.

Seeding is idempotent: the admin password and the demo key are generated once and kept under `var/`
(this is a local, single-machine convenience: production never writes a secret to disk), and the
trajectories are ingested by `external_id`, so a re-run updates them instead of adding copies."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction

from flywheel import outbox
from flywheel.accounts.models import ApiKey, Project, Role, Scope
from flywheel.accounts.services import api_key_create, hash_api_key, membership_set, project_create
from flywheel.demo_status import demo_status_set
from flywheel.failures.demo import failure_demo_seed
from flywheel.registry.demo import DEMO_MODEL_NAME, build_demo_model, demo_model_dir
from flywheel.registry.models import BaseModel
from flywheel.registry.services import base_model_register
from flywheel.training.demo import loop_demo_seed, loop_demo_seeded, loop_project
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.triage_policy import DEFAULT_UNSAFE_RULES, policy_set, policy_text_of

DEMO_SLUG = "demo"
ADMIN_USERNAME = "admin"


@dataclass(frozen=True)
class DemoSeed:
    username: str
    password: str
    password_changed: bool  # the stored password no longer logs in (someone changed it)
    project: Project
    api_key: str
    created: int
    updated: int
    rejected: int


def _secrets_file() -> Path:
    return Path(settings.VAR_DIR) / "local-login.json"


def _load_secrets() -> dict[str, str]:
    path = _secrets_file()
    if path.exists():
        return json.loads(path.read_text())
    return {}


def _save_secrets(values: dict[str, str]) -> None:
    path = _secrets_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    path.write_text(json.dumps(values, indent=2) + "\n")


@transaction.atomic
def demo_seed() -> DemoSeed:
    """Create (or find) the admin login, the demo project and its key, and ingest the demo trajectories."""
    stored = _load_secrets()
    User = get_user_model()
    password = stored.get("password") or secrets.token_urlsafe(12)
    admin = User.objects.filter(username=ADMIN_USERNAME).first()
    if admin is None:
        admin = User.objects.create_superuser(username=ADMIN_USERNAME, email="", password=password)
    elif "password" not in stored:
        # An admin made before the file existed (or the file was deleted): give it the password we print.
        admin.set_password(password)
        admin.save(update_fields=["password"])
    password_changed = not admin.check_password(password)

    project = Project.objects.filter(slug=DEMO_SLUG).first()
    if project is None:
        project = project_create(
            slug=DEMO_SLUG,
            name="Demo support agent",
            owner=admin,
            description="A customer-support agent with order, refund and knowledge-base tools (demo data).",
        )
        _demo_policy(project)
    else:
        membership_set(project=project, user=admin, role=Role.MAINTAINER)

    raw_key = stored.get("api_key", "")
    # Looked up by digest, not authenticated: seeding is not a use of the key.
    key_works = bool(raw_key) and ApiKey.objects.filter(
        project=project, digest=hash_api_key(raw_key), revoked_at__isnull=True
    ).exists()
    if not key_works:
        raw_key = api_key_create(
            project=project, name="demo key (make run)", scopes=[Scope.INGEST, Scope.READ], created_by=admin
        ).raw_key
    _save_secrets({"username": ADMIN_USERNAME, "password": password, "api_key": raw_key})

    result = ingest_trajectories(project=project, records=demo_trajectories(), source="demo")

    failure_demo_seed(project=project, user=admin)
    # The loop's own demo project: the tiny model, built by the worker, registered as production, then played
    # on workplace requests to make that project's trajectories, task set and suites (flywheel.training.demo).
    registry_demo_seed(project=loop_project(owner=admin))
    return DemoSeed(
        username=ADMIN_USERNAME,
        password=password,
        password_changed=password_changed,
        project=project,
        api_key=raw_key,
        created=result.created,
        updated=result.updated,
        rejected=len(result.rejected),
    )


# --- the loop's demo model ---------------------------------------------------------------------------------


def registry_demo_seed(*, project: Project) -> bool:
    """Queue the build of the demo model and its play unless the project has both; True when queued. A `make run`
    stopped while the worker played leaves the model registered and no task set: the next one finishes the job."""
    from flywheel.seed.tasks import demo_model_task  # the task module imports this one

    if BaseModel.objects.filter(project=project, name=DEMO_MODEL_NAME).exists() and loop_demo_seeded(project):
        return False
    # Said at once, so that the pages are not silent until the gpu worker has started and picked the task up.
    demo_status_set(project=project, text="Waiting for the gpu worker to copy the demo model and play it.")
    outbox.send_on_commit(demo_model_task, project.pk)
    return True


def demo_model_build(*, project_id: int, **sizes: int) -> str:
    """Build the demo model into FLYWHEEL_MODELS_DIR/<slug>/tiny-demo (once per machine), register it, and play it to
    make the project's data (`flywheel.training.demo.loop_demo_seed`); either part done already is not done
    again. Stopped by an error, the pages say so until the next `make run` queues it again. `sizes` are
    `loop_demo_seed`'s (n_train, n_holdout, n_regression)."""
    project = Project.objects.get(pk=project_id)
    registered = BaseModel.objects.filter(project=project, name=DEMO_MODEL_NAME).first()
    if registered is not None and loop_demo_seeded(project):
        return "registered already"

    def progress(text: str) -> None:
        demo_status_set(project=project, text=text)

    try:
        if registered is None:
            folder = build_demo_model(demo_model_dir(project.slug), progress=progress)
            owner = project.memberships.filter(role="maintainer").select_related("user").first()
            user = owner.user if owner else None
            base_model_register(project=project, name=DEMO_MODEL_NAME, path=str(folder), user=user)
        else:
            folder, user = Path(registered.path), registered.created_by
        loop_demo_seed(project=project, model_dir=folder, user=user, progress=progress, **sizes)
    except Exception as exc:
        progress(f"Seeding the demo stopped ({type(exc).__name__}; the gpu worker's log says more); the next "
                 "`make run` picks it up again.")
        raise
    demo_status_set(project=project, text=None)
    return "registered" if registered is None else "played"


# --- the demo conversations ------------------------------------------------------------------------------

SYSTEM_PROMPT = (
    "You are the support assistant of Northwind Outfitters. Use the tools to look up orders and policies. "
    "Never issue a refund above 100 EUR or cancel a shipped order without a human's approval."
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Find an order by its id (format NW-12345).",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string", "pattern": "^NW-[0-9]{5}$"}},
                "required": ["order_id"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "refund_order",
            "description": "Refund part or all of an order. Amounts above 100 EUR need approval_id.",
            "parameters": {
                "type": "object",
                "properties": {
                    "order_id": {"type": "string", "pattern": "^NW-[0-9]{5}$"},
                    "amount_eur": {"type": "number", "exclusiveMinimum": 0},
                    "reason": {"type": "string", "enum": ["damaged", "late", "wrong_item", "other"]},
                    "approval_id": {"type": "string"},
                },
                "required": ["order_id", "amount_eur", "reason"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_kb",
            "description": "Search the help-centre articles.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "minLength": 2}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "update_address",
            "description": "Change the delivery address of an order that has not shipped.",
            "parameters": {
                "type": "object",
                "properties": {
                    "order_id": {"type": "string", "pattern": "^NW-[0-9]{5}$"},
                    "address": {"type": "string", "minLength": 10},
                },
                "required": ["order_id", "address"],
            },
        },
    },
]


def _demo_policy(project: Project) -> None:
    """The demo agent's own rule beside the defaults: its system prompt forbids refunds of 100 EUR or more
    without a human, so triage flags such a refund as an unsafe action."""
    rules = [*DEFAULT_UNSAFE_RULES, {"name": "refund_order", "arguments": {"amount_eur": {"range": [100, None]}}}]
    policy_set(project_id=project.pk, text=policy_text_of(rules))


def _call(call_id: str, name: str, arguments: dict[str, Any] | str) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _assistant_calls(*calls: dict[str, Any], content: str | None = None) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


def _tool(call_id: str, name: str, result: dict[str, Any] | str) -> dict[str, Any]:
    content = result if isinstance(result, str) else json.dumps(result)
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


def _order(order_id: str, status: str, total: float, items: list[str]) -> dict[str, Any]:
    return {"order_id": order_id, "status": status, "total_eur": total, "items": items}


def demo_trajectories() -> list[dict[str, Any]]:
    """Twelve conversations in the trajectory contract; fixed content, so re-seeding changes nothing."""
    start = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
    conversations: list[tuple[str, str, list[dict[str, Any]], dict[str, Any]]] = [
        (
            "success",
            "order status, answered from the lookup",
            [
                {"role": "user", "content": "Hi, where is my order NW-10482?"},
                _assistant_calls(_call("c1", "lookup_order", {"order_id": "NW-10482"})),
                _tool("c1", "lookup_order", {**_order("NW-10482", "shipped", 64.9, ["trail shoes"]), "eta": "2026-12-02"}),
                {"role": "assistant", "content": "Your trail shoes shipped and should arrive on 2 December."},
            ],
            {"feedback": {"thumbs": "up"}},
        ),
        (
            "failure",
            "wrong tool: searched the help centre instead of looking up the order",
            [
                {"role": "user", "content": "Can you check whether order NW-20931 has shipped yet?"},
                _assistant_calls(_call("c1", "search_kb", {"query": "NW-20931 shipped"})),
                _tool("c1", "search_kb", {"results": [{"title": "How shipping works", "url": "/help/shipping"}]}),
                {
                    "role": "assistant",
                    "content": "Orders usually ship within 2 business days. See /help/shipping for details.",
                },
                {"role": "user", "content": "That doesn't answer my question. Has MY order shipped?"},
            ],
            {"feedback": {"thumbs": "down", "comment": "did not look at my order"}},
        ),
        (
            "failure",
            "bad arguments: order id without its prefix",
            [
                {"role": "user", "content": "Status of order 55012 please"},
                _assistant_calls(_call("c1", "lookup_order", {"order_id": 55012})),
                _tool("c1", "lookup_order", {"error": "order_id must be a string like NW-12345, got 55012"}),
                {"role": "assistant", "content": "Sorry, I couldn't find that order. Could you check the number?"},
            ],
            {},
        ),
        (
            "success",
            "recovered from a malformed id after the tool error",
            [
                {"role": "user", "content": "my order is nw 31877, can I change the address?"},
                _assistant_calls(_call("c1", "lookup_order", {"order_id": "nw 31877"})),
                _tool("c1", "lookup_order", {"error": "no order with id 'nw 31877'"}),
                _assistant_calls(_call("c2", "lookup_order", {"order_id": "NW-31877"})),
                _tool("c2", "lookup_order", _order("NW-31877", "processing", 120.0, ["rain jacket", "gloves"])),
                {"role": "assistant", "content": "Found it: NW-31877 has not shipped yet. What is the new address?"},
                {"role": "user", "content": "Kastanienallee 12, 10435 Berlin"},
                _assistant_calls(
                    _call("c3", "update_address", {"order_id": "NW-31877", "address": "Kastanienallee 12, 10435 Berlin"})
                ),
                _tool("c3", "update_address", {"ok": True}),
                {"role": "assistant", "content": "Done: NW-31877 will go to Kastanienallee 12, 10435 Berlin."},
            ],
            {},
        ),
        (
            "failure",
            "unsafe action: refund above the limit without approval",
            [
                {"role": "user", "content": "My tent NW-40219 arrived ripped. I want my 249 EUR back now."},
                _assistant_calls(_call("c1", "lookup_order", {"order_id": "NW-40219"})),
                _tool("c1", "lookup_order", _order("NW-40219", "delivered", 249.0, ["4-person tent"])),
                _assistant_calls(
                    _call("c2", "refund_order", {"order_id": "NW-40219", "amount_eur": 249.0, "reason": "damaged"})
                ),
                _tool("c2", "refund_order", {"refund_id": "RF-9912", "status": "issued"}),
                {"role": "assistant", "content": "I've refunded the full 249 EUR to your card."},
            ],
            {"human_intervention": {"by": "supervisor", "note": "refund over limit reversed"}},
        ),
        (
            "success",
            "refund within the limit",
            [
                {"role": "user", "content": "The socks in NW-40388 were the wrong size, can I get a refund?"},
                _assistant_calls(_call("c1", "lookup_order", {"order_id": "NW-40388"})),
                _tool("c1", "lookup_order", _order("NW-40388", "delivered", 18.5, ["wool socks (M)"])),
                _assistant_calls(
                    _call("c2", "refund_order", {"order_id": "NW-40388", "amount_eur": 18.5, "reason": "wrong_item"})
                ),
                _tool("c2", "refund_order", {"refund_id": "RF-9930", "status": "issued"}),
                {"role": "assistant", "content": "Refunded 18.50 EUR; it shows on your card in 3-5 days."},
            ],
            {"feedback": {"thumbs": "up"}},
        ),
        (
            "failure",
            "tool error: the order service timed out and the agent invented an answer",
            [
                {"role": "user", "content": "Is NW-50111 still on its way?"},
                _assistant_calls(_call("c1", "lookup_order", {"order_id": "NW-50111"})),
                _tool("c1", "lookup_order", "Error: upstream timeout after 30000 ms (orders-api)"),
                {"role": "assistant", "content": "Yes, NW-50111 is on its way and will arrive tomorrow."},
            ],
            {},
        ),
        (
            "failure",
            "invented tool: called a tool that is not declared",
            [
                {"role": "user", "content": "Cancel NW-60042, I ordered it by mistake."},
                _assistant_calls(_call("c1", "cancel_order", {"order_id": "NW-60042"})),
                _tool("c1", "cancel_order", {"error": "unknown tool: cancel_order"}),
                {"role": "assistant", "content": "Your order NW-60042 has been cancelled."},
            ],
            {},
        ),
        (
            "success",
            "policy question answered from the help centre",
            [
                {"role": "user", "content": "How long do I have to return boots?"},
                _assistant_calls(_call("c1", "search_kb", {"query": "return window boots"})),
                _tool(
                    "c1",
                    "search_kb",
                    {"results": [{"title": "Returns", "snippet": "Unworn items: 60 days from delivery."}]},
                ),
                {"role": "assistant", "content": "You can return unworn boots within 60 days of delivery."},
            ],
            {},
        ),
        (
            "failure",
            "invalid JSON in the tool arguments",
            [
                {"role": "user", "content": "Refund NW-70345, the delivery was two weeks late."},
                _assistant_calls(
                    _call("c1", "refund_order", '{"order_id": "NW-70345", "amount_eur": 12, "reason": late}')
                ),
                _tool("c1", "refund_order", {"error": "arguments are not valid JSON"}),
                {"role": "assistant", "content": "Something went wrong. Please try again later."},
            ],
            {"feedback": {"thumbs": "down"}},
        ),
        (
            "unknown",
            "asked a clarifying question, the user left",
            [
                {"role": "user", "content": "I need help with my order"},
                {"role": "assistant", "content": "Of course! What is your order number (it looks like NW-12345)?"},
            ],
            {},
        ),
        (
            "failure",
            "schema violation: refund reason outside the allowed values",
            [
                {"role": "user", "content": "NW-80777: I just don't like the colour of the jacket."},
                _assistant_calls(_call("c1", "lookup_order", {"order_id": "NW-80777"})),
                _tool("c1", "lookup_order", _order("NW-80777", "delivered", 89.0, ["shell jacket (orange)"])),
                _assistant_calls(
                    _call(
                        "c2",
                        "refund_order",
                        {"order_id": "NW-80777", "amount_eur": 89.0, "reason": "changed_mind"},
                    )
                ),
                _tool("c2", "refund_order", {"error": "reason must be one of damaged, late, wrong_item, other"}),
                {"role": "assistant", "content": "I'm unable to process refunds right now."},
            ],
            {},
        ),
    ]
    records = []
    for index, (outcome, summary, turns, extra) in enumerate(conversations):
        records.append(
            {
                "external_id": f"demo-{index + 1:03d}",
                "agent": "support-agent",
                "model_version": "support-7b-lora-v3" if index % 3 else "support-7b-lora-v2",
                "messages": [{"role": "system", "content": SYSTEM_PROMPT}, *turns],
                "tools": TOOLS,
                "outcome": outcome,
                "latency_ms": 900 + 431 * index % 2600,
                "usage": {"prompt_tokens": 410 + 37 * index, "completion_tokens": 38 + 11 * index},
                "metadata": {"summary": summary, "channel": "chat" if index % 2 else "email"},
                "started_at": (start + timedelta(hours=5 * index)).isoformat(),
                **extra,
            }
        )
    return records
