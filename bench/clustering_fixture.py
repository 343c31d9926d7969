"""Labeled failures with known causes: synthetic agent trajectories (OpenAI chat format) of a support and
travel assistant, each failing for one of CAUSES, with varied wording (several request templates, slot
values, error texts, replies, optional small talk and an earlier successful step).

Used by bench/clustering.py (quality: homogeneity, completeness, ARI against the known cause; and the 10,000
failures of the throughput run) and by the clustering tests. Causes share tools and signal kinds on purpose:
two causes on `issue_refund` are both tool errors, two on `create_ticket` break its arguments differently,
two on `run_sql` differ in kind, and two end in negative feedback on different tools, so that neither the
tool name nor the signal kind alone separates them.

    failures(n, seed=0) -> [(cause, record)]   records ready for ingestion (`ingest_trajectories`)

A small project's failures (SMALL_CAUSES, `small_failures`): 30 to 60 failures of 3 to 5 causes, the shape of
the loop demo's: a workplace assistant's single-turn requests, each trajectory ending on the model's tool
call, so every failure carries the same signal (no final answer) and the causes differ only by the request
and the call it got wrong. Causes come in uneven shares, as a real project's do.

    small_failures(n, seed=0, causes=None) -> [(cause, record)]

Either fixture's records, or bench/clustering_api_fixture.py's, as the clustering engine reads them (signals
from the real detectors under the default policy; needs Django set up):

    signatures(data) -> (causes, signatures)
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


TOOLS = [
    _tool(
        "search_flights",
        "Search flights between two airports on a day.",
        {
            "origin": {"type": "string"},
            "destination": {"type": "string"},
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        },
        ["origin", "destination", "date"],
    ),
    _tool("get_weather", "Current weather and forecast for a city.", {"city": {"type": "string"}}, ["city"]),
    _tool("lookup_order", "Find an order by its id.", {"order_id": {"type": "string"}}, ["order_id"]),
    _tool(
        "issue_refund",
        "Refund an order, in full or in part.",
        {"order_id": {"type": "string"}, "amount": {"type": "number"}, "reason": {"type": "string"}},
        ["order_id", "amount"],
    ),
    _tool("run_sql", "Run a read-only SQL query on the analytics warehouse.", {"query": {"type": "string"}}, ["query"]),
    _tool(
        "create_ticket",
        "Open a support ticket.",
        {
            "title": {"type": "string"},
            "priority": {"type": "string", "enum": ["low", "medium", "high"]},
            "body": {"type": "string"},
        },
        ["title", "priority"],
    ),
    _tool("get_stock_price", "Latest price of a stock by ticker.", {"ticker": {"type": "string"}}, ["ticker"]),
    _tool(
        "convert_currency",
        "Convert an amount between currencies at today's rate.",
        {"amount": {"type": "number"}, "source": {"type": "string"}, "target": {"type": "string"}},
        ["amount", "source", "target"],
    ),
    _tool("kb_search", "Search the help-centre articles.", {"query": {"type": "string"}}, ["query"]),
]

CITIES = ["Paris", "Lisbon", "Berlin", "Madrid", "Rome", "Oslo", "Dublin", "Vienna", "Prague", "Athens", "Boston", "Denver"]
AIRPORTS = ["CDG", "LIS", "BER", "MAD", "FCO", "OSL", "DUB", "VIE", "PRG", "ATH", "BOS", "DEN", "JFK", "SFO"]
NAMES = ["Ana", "Ben", "Chloé", "Dev", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jules", "Kenji", "Lena"]
PRODUCTS = ["headphones", "a blender", "running shoes", "a desk lamp", "the winter jacket", "a phone case", "a kettle"]
TICKERS = ["AAPL", "MSFT", "NVDA", "TSLA", "AMZN", "GOOG", "META", "ORCL", "IBM", "SAP"]
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "SEK"]
TABLES = ["orders", "customers", "sessions", "payments", "refunds", "signups"]
GREETINGS = ["", "", "", "Hi! ", "Hello, ", "Hey there. ", "Good morning. ", "Quick question: "]
SORRY = [
    "Sorry, something went wrong on my side.",
    "I ran into a problem, let me know if you want me to try again.",
    "Apologies, I could not complete that.",
    "Unfortunately that did not work.",
]


class _Builder:
    """One trajectory's messages, with tool-call ids numbered in order."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.messages: list[dict[str, Any]] = []
        self.n = 0

    def user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def say(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def call(self, name: str, arguments: dict[str, Any] | str, result: str | None = None) -> None:
        self.n += 1
        call_id = f"call_{self.n}"
        raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
        self.messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": raw}}],
            }
        )
        if result is not None:
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": result})

    def small_talk(self) -> None:
        """Sometimes an earlier, successful exchange: failures rarely start a conversation."""
        if self.rng.random() < 0.3:
            city = self.rng.choice(CITIES)
            self.user(f"What's the weather like in {city}?")
            self.call("get_weather", {"city": city}, json.dumps({"city": city, "temp_c": self.rng.randint(-5, 32)}))
            self.say(f"It is {self.rng.choice(['sunny', 'cloudy', 'rainy', 'windy'])} in {city} right now.")


def _order_id(rng: random.Random) -> str:
    return f"ORD-{rng.randint(10000, 99999)}"


def _flight_date_format(b: _Builder, r: random.Random) -> None:
    origin, destination = r.sample(AIRPORTS, 2)
    when = r.choice(["next Friday", "12/03/2026", "March 3rd", "tomorrow morning", "3 Dec", "the 14th", "Monday"])
    b.user(
        r.choice(GREETINGS)
        + r.choice(
            [
                f"Find me a flight from {origin} to {destination} {when}.",
                f"Can you look up flights {origin} -> {destination} for {when}?",
                f"I need to fly {origin} to {destination} on {when}, what's available?",
                f"Any cheap flights from {origin} to {destination} {when}?",
                f"Please search {origin}-{destination} departures {when}.",
            ]
        )
    )
    b.call("search_flights", {"origin": origin, "destination": destination, "date": when}, json.dumps({"error": "invalid date"}))
    b.say(r.choice(SORRY))


def _refund_unknown_order(b: _Builder, r: random.Random) -> None:
    product = r.choice(PRODUCTS)
    order = _order_id(r)
    b.user(
        r.choice(GREETINGS)
        + r.choice(
            [
                f"I want my money back for {product}.",
                f"Please refund {product}, it arrived broken.",
                f"Refund me for {product} I bought last week.",
                f"{product} never showed up. I'd like a refund.",
                f"Can I get a refund on {product}?",
            ]
        )
    )
    b.call(
        "issue_refund",
        {"order_id": order, "amount": r.choice([19.99, 49.0, 35.5, 79.0]), "reason": "customer request"},
        r.choice(
            [
                f"Error: order {order} not found",
                f"Error: no order with id {order}",
                json.dumps({"error": f"Order {order} does not exist"}),
                f"Error: unknown order {order}",
            ]
        ),
    )
    b.say(r.choice(SORRY + ["I could not find that order. Can you give me the order number?"]))


def _refund_over_total(b: _Builder, r: random.Random) -> None:
    product = r.choice(PRODUCTS)
    order = _order_id(r)
    total = r.choice([20, 35, 60, 80])
    b.user(
        r.choice(GREETINGS)
        + r.choice(
            [
                f"Order {order}: refund the shipping and {product}, plus compensation please.",
                f"I was charged twice for {product} in {order}, refund everything.",
                f"Give me a full refund plus the delivery fee on {order}.",
                f"Refund {order} and add something for the trouble.",
            ]
        )
    )
    b.call("lookup_order", {"order_id": order}, json.dumps({"order_id": order, "total": total, "items": [product]}))
    b.call(
        "issue_refund",
        {"order_id": order, "amount": total + r.choice([5, 10, 15, 20]), "reason": "compensation"},
        r.choice(
            [
                f"Error: refund amount exceeds order total of {total}.00",
                f"Error: amount greater than the amount paid ({total}.00)",
                json.dumps({"error": f"Refund exceeds captured amount {total}.00"}),
                f"Error: cannot refund more than the order total ({total})",
            ]
        ),
    )
    b.say(r.choice(SORRY))


def _weather_undeclared(b: _Builder, r: random.Random) -> None:
    city = r.choice(CITIES)
    b.user(
        r.choice(GREETINGS)
        + r.choice(
            [
                f"Will it rain in {city} this weekend?",
                f"What's the forecast for {city} for the next five days?",
                f"Should I pack an umbrella for {city} on Saturday?",
                f"Give me the 3-day outlook for {city}.",
            ]
        )
    )
    name = r.choice(["get_forecast", "weather_forecast", "get_weather_forecast", "forecast"])
    b.call(name, {"city": city, "days": r.choice([3, 5, 7])}, f"Error: unknown tool {name}")
    b.say(r.choice(SORRY + ["I can't get the forecast right now."]))


def _order_lookup_loop(b: _Builder, r: random.Random) -> None:
    order = _order_id(r)
    b.user(
        r.choice(GREETINGS)
        + r.choice(
            [
                f"Where is my order {order}?",
                f"Has {order} shipped yet?",
                f"Track order {order} for me please.",
                f"What's the status of {order}?",
            ]
        )
    )
    for _ in range(r.choice([3, 3, 4, 5])):
        b.call("lookup_order", {"order_id": order}, json.dumps({"order_id": order, "status": "processing"}))
    b.say(r.choice(["It is still processing.", "Your order is being processed.", "Still processing, it seems."]))


def _sql_syntax(b: _Builder, r: random.Random) -> None:
    table = r.choice(TABLES)
    b.user(
        r.choice(GREETINGS)
        + r.choice(
            [
                f"How many {table} did we get last month?",
                f"Count the {table} by week for this quarter.",
                f"Pull the top 10 days by {table} this year.",
                f"What was the average number of {table} per day in October?",
            ]
        )
    )
    query = r.choice(
        [
            f"SELECT COUNT(*) FORM {table} WHERE created_at > now() - interval '1 month'",
            f"SELECT date_trunc('week', created_at) AS w, COUNT(* FROM {table} GROUP BY 1",
            f"SELECT day, COUNT(*) FROM {table} GROUP BY day ORDER BY 2 DESC LIMIT10",
            f"SELEC AVG(n) FROM (SELECT COUNT(*) n FROM {table} GROUP BY created_at::date)",
        ]
    )
    error = r.choice(
        [
            f'Error: syntax error at or near "{r.choice(["FORM", "FROM", "LIMIT10", "SELEC"])}"',
            "Error: syntax error at end of input",
            f"Error: ParserError: unexpected token at position {r.randint(10, 80)}",
        ]
    )
    b.call("run_sql", {"query": query}, error)
    b.say(r.choice(SORRY + ["The query failed, I'll need to fix it."]))


def _sql_destructive(b: _Builder, r: random.Random) -> None:
    table = r.choice(TABLES)
    b.user(
        r.choice(GREETINGS)
        + r.choice(
            [
                f"Clean up the test rows in {table}.",
                f"Remove the duplicate {table} from yesterday's import.",
                f"Get rid of the junk entries in {table}.",
                f"Purge old {table} older than two years.",
            ]
        )
    )
    query = r.choice(
        [
            f"DELETE FROM {table} WHERE is_test = true",
            f"DELETE FROM {table} WHERE created_at < now() - interval '2 years'",
            f"TRUNCATE {table}",
            f"DROP TABLE {table}_staging",
        ]
    )
    b.call("run_sql", {"query": query}, json.dumps({"rows_affected": r.randint(3, 5000)}))
    b.say(r.choice(["Done, the rows are gone.", "I removed them.", "Cleaned up.", "All deleted."]))


def _ticket_bad_json(b: _Builder, r: random.Random) -> None:
    name = r.choice(NAMES)
    b.user(
        r.choice(GREETINGS)
        + r.choice(
            [
                f"Open a ticket: {name} can't log in to the dashboard.",
                f"Please file a bug, the export button does nothing for {name}.",
                f"Create a support ticket about {name}'s missing invoice.",
                f"Log a ticket for {name}: password reset email never arrives.",
            ]
        )
    )
    arguments = r.choice(
        [
            '{"title": "Login issue", "priority": "high", "body": "User cannot log in',
            '{"title": "Export broken", priority: "medium"}',
            "{'title': 'Missing invoice', 'priority': 'low'}",
            '{"title": "Password reset", "priority": "high",}',
        ]
    )
    b.call("create_ticket", arguments, "Error: could not parse arguments")
    b.say(r.choice(SORRY))


def _ticket_bad_priority(b: _Builder, r: random.Random) -> None:
    name = r.choice(NAMES)
    b.user(
        r.choice(GREETINGS)
        + r.choice(
            [
                f"This is urgent: {name}'s account is locked, open a ticket.",
                f"Escalate: checkout is down for {name}, file it as critical.",
                f"Open a P1 ticket, {name} is blocked from paying.",
                f"ASAP please, ticket for {name}: the app crashes on start.",
            ]
        )
    )
    priority = r.choice(["urgent", "critical", "P1", "asap", "highest"])
    b.call(
        "create_ticket",
        {"title": r.choice(["Account locked", "Checkout down", "Payment blocked", "App crash"]), "priority": priority},
        f"Error: invalid priority '{priority}'",
    )
    b.say(r.choice(SORRY))


def _stock_timeout(b: _Builder, r: random.Random) -> None:
    ticker = r.choice(TICKERS)
    b.user(
        r.choice(GREETINGS)
        + r.choice(
            [
                f"What's {ticker} trading at?",
                f"Price of {ticker} right now?",
                f"How is {ticker} doing today?",
                f"Quote me {ticker}.",
            ]
        )
    )
    b.call(
        "get_stock_price",
        {"ticker": ticker},
        r.choice(
            [
                "Error: upstream timeout after 30s",
                "Error: request timed out",
                json.dumps({"error": "gateway timeout", "status": 504}),
                "Error: market data service did not respond in time",
            ]
        ),
    )
    # The episode stops here: the agent never answers.


def _currency_wrong_answer(b: _Builder, r: random.Random) -> None:
    amount = r.choice([50, 100, 250, 1200, 75])
    source, target = r.sample(CURRENCIES, 2)
    rate = round(r.uniform(0.5, 1.6), 4)
    b.user(
        r.choice(GREETINGS)
        + r.choice(
            [
                f"How much is {amount} {source} in {target}?",
                f"Convert {amount} {source} to {target} please.",
                f"What do I get for {amount} {source} in {target}?",
                f"{amount} {source} to {target}?",
            ]
        )
    )
    b.call("convert_currency", {"amount": amount, "source": source, "target": target}, json.dumps({"result": round(amount * rate, 2), "rate": rate}))
    wrong = round(amount / rate, 2)
    b.say(r.choice([f"That's {wrong} {target}.", f"You'd get about {wrong} {target}.", f"{amount} {source} is {wrong} {target}."]))


def _kb_policy_invented(b: _Builder, r: random.Random) -> None:
    topic = r.choice(["returns after 60 days", "student discounts", "price matching", "lifetime warranty", "gift wrapping"])
    b.user(
        r.choice(GREETINGS)
        + r.choice(
            [
                f"Do you offer {topic}?",
                f"What's your policy on {topic}?",
                f"Is {topic} something you support?",
                f"Tell me about {topic}.",
            ]
        )
    )
    b.call("kb_search", {"query": topic}, json.dumps({"results": []}))
    b.say(
        r.choice(
            [
                f"Yes, we offer {topic} on all orders.",
                f"Absolutely, {topic} is included for every customer.",
                f"Our policy covers {topic} at no extra cost.",
            ]
        )
    )


# cause -> (builder, feedback) ; feedback None: none sent.
CAUSES: dict[str, tuple[Callable[[_Builder, random.Random], None], Any]] = {
    "flight_date_format": (_flight_date_format, None),
    "refund_unknown_order": (_refund_unknown_order, None),
    "refund_over_total": (_refund_over_total, None),
    "weather_undeclared_tool": (_weather_undeclared, None),
    "order_lookup_loop": (_order_lookup_loop, None),
    "sql_syntax_error": (_sql_syntax, None),
    "sql_destructive": (_sql_destructive, None),
    "ticket_bad_json": (_ticket_bad_json, None),
    "ticket_bad_priority": (_ticket_bad_priority, None),
    "stock_timeout": (_stock_timeout, None),
    "currency_wrong_answer": (_currency_wrong_answer, {"thumbs": "down"}),
    "kb_policy_invented": (_kb_policy_invented, {"rating": 1}),
}


def failure(cause: str, i: int, *, seed: int = 0, prefix: str = "fx") -> dict[str, Any]:
    """One failing trajectory of `cause`, deterministic in (cause, i, seed)."""
    build, feedback = CAUSES[cause]
    rng = random.Random(f"{seed}:{cause}:{i}")
    b = _Builder(rng)
    b.small_talk()
    build(b, rng)
    record: dict[str, Any] = {
        "external_id": f"{prefix}-{cause}-{i}",
        "agent": "support-assistant",
        "model_version": rng.choice(["v7", "v8"]),
        "messages": [{"role": "system", "content": "You are a helpful support and travel assistant."}, *b.messages],
        "tools": TOOLS,
        "outcome": "failure",
    }
    if feedback is not None:
        record["feedback"] = feedback
    return record


def failures(n: int, *, seed: int = 0, prefix: str = "fx", causes: list[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """`n` failures spread evenly over `causes` (all by default), interleaved: [(cause, record)]."""
    names = causes or list(CAUSES)
    return [(names[i % len(names)], failure(names[i % len(names)], i // len(names), seed=seed, prefix=prefix)) for i in range(n)]


# --- a small project's failures --------------------------------------------------------------------------

WORKPLACE_TOOLS = [
    _tool(
        "create_task",
        "Create a task.",
        {"title": {"type": "string"}, "project": {"type": "string"}, "assignee": {"type": "string"}},
        ["title", "project"],
    ),
    _tool(
        "update_task",
        "Change a task's status or assignee.",
        {
            "task_id": {"type": "string"},
            "status": {"type": "string", "enum": ["open", "in_progress", "done"]},
            "assignee": {"type": "string"},
        },
        ["task_id"],
    ),
    _tool(
        "create_event",
        "Create a calendar event.",
        {
            "title": {"type": "string"},
            "date": {"type": "string"},
            "time": {"type": "string"},
            "attendees": {"type": "array", "items": {"type": "string"}},
        },
        ["title", "date", "time", "attendees"],
    ),
    _tool("send_email", "Send an email.", {"to": {"type": "string"}, "subject": {"type": "string"}}, ["to", "subject"]),
    _tool("list_tasks", "List tasks.", {"assignee": {"type": "string"}}, []),
]
TEAM = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mike", "Nina"]
PROJECT_NAMES = ["Apollo", "Borealis", "Cobalt", "Delta", "Ember", "Falcon", "Granite", "Harbor"]
TASK_TITLES = [
    f"{verb} {thing}"
    for verb in ("Fix", "Update", "Review", "Draft", "Plan", "Ship")
    for thing in ("login page", "pricing doc", "release notes", "onboarding flow", "api docs", "dashboard")
]
EVENT_TITLES = [
    f"{p} {kind}" for p in PROJECT_NAMES for kind in ("design review", "budget sync", "customer call", "retro")
]
TIMES = ["09:00", "10:00", "11:30", "13:00", "14:00", "15:30", "16:00"]
WORKPLACE_SYSTEM = "You are the Acme workplace assistant. Today is 2026-03-02. Use the tools, then answer briefly."


def _other(r: random.Random, pool: list[str], value: str) -> str:
    return r.choice([v for v in pool if v != value])


def _answer(b: _Builder, name: str, arguments: dict[str, Any]) -> None:
    """The model's one call, the last message: the loop demo records its first call and judges it."""
    b.n += 1
    function = {"name": name, "arguments": json.dumps(arguments)}
    call = {"id": f"call_0_{b.n - 1}", "type": "function", "function": function}
    b.messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _task_id(r: random.Random) -> str:
    return f"T{r.randint(1, 9)}"


def _reassign_wrong_person(b: _Builder, r: random.Random) -> None:
    task, title, who = _task_id(r), r.choice(TASK_TITLES), r.choice(TEAM)
    b.user(
        r.choice(
            [f'Reassign "{title}" ({task}) to {who}.', f'Give task {task} "{title}" to {who}.', f'Assign {task} "{title}" to {who}.']
        )
    )
    _answer(b, "update_task", {"task_id": task, "assignee": _other(r, TEAM, who)})


def _status_wrong_task(b: _Builder, r: random.Random) -> None:
    task, title = _task_id(r), r.choice(TASK_TITLES)
    status, word = r.choice([("done", "done"), ("in_progress", "in progress")])
    b.user(
        r.choice(
            [f'Mark "{title}" ({task}) as {word}.', f'Set task {task} "{title}" to {word}.', f'Please mark task {task}, "{title}", {word}.']
        )
    )
    _answer(b, "update_task", {"task_id": _other(r, [f"T{i}" for i in range(1, 10)], task), "status": status})


def _email_wrong_recipient(b: _Builder, r: random.Random) -> None:
    who, title = r.choice(TEAM), r.choice(TASK_TITLES)
    b.user(r.choice([f'Email {who} about "{title}".', f'Send {who} an email titled "{title}".']))
    subject = title if r.random() < 0.5 else _other(r, TASK_TITLES, title)
    _answer(b, "send_email", {"to": _other(r, TEAM, who), "subject": subject})


def _event_wrong_details(b: _Builder, r: random.Random) -> None:
    title = r.choice(EVENT_TITLES)
    first, second = r.sample(TEAM, 2)
    day, time = f"2026-03-{r.randint(3, 27):02d}", r.choice(TIMES)
    b.user(
        r.choice(
            [f'Schedule "{title}" on {day} at {time} with {first} and {second}.', f'Book "{title}" for {first} and {second} on {day} at {time}.']
        )
    )
    wrong_title, wrong_time = _other(r, EVENT_TITLES, title), _other(r, TIMES, time)
    _answer(b, "create_event", {"title": wrong_title, "date": day, "time": wrong_time, "attendees": r.sample(TEAM, 2)})


def _task_wrong_project(b: _Builder, r: random.Random) -> None:
    title, project, who = r.choice(TASK_TITLES), r.choice(PROJECT_NAMES), r.choice(TEAM)
    b.user(
        r.choice(
            [
                f'Create a task "{title}" in {project} for {who}.',
                f'Add task "{title}" to {project}, assigned to {who}.',
                f'New task in {project} for {who}: "{title}".',
            ]
        )
    )
    wrong_title, wrong_project = _other(r, TASK_TITLES, title), _other(r, PROJECT_NAMES, project)
    _answer(b, "create_task", {"title": wrong_title, "project": wrong_project, "assignee": who})


# cause -> (builder, share): shares are uneven, as a real project's causes are.
SMALL_CAUSES: dict[str, tuple[Callable[[_Builder, random.Random], None], float]] = {
    "reassign_wrong_person": (_reassign_wrong_person, 3.0),
    "status_wrong_task": (_status_wrong_task, 2.0),
    "email_wrong_recipient": (_email_wrong_recipient, 2.0),
    "event_wrong_details": (_event_wrong_details, 1.5),
    "task_wrong_project": (_task_wrong_project, 1.5),
}


def small_failure(cause: str, i: int, *, seed: int = 0, prefix: str = "sm") -> dict[str, Any]:
    """One failing single-turn trajectory of a small-fixture `cause`, deterministic in (cause, i, seed)."""
    build, _ = SMALL_CAUSES[cause]
    rng = random.Random(f"small:{seed}:{cause}:{i}")
    b = _Builder(rng)
    build(b, rng)
    return {
        "external_id": f"{prefix}-{cause}-{i}",
        "agent": "workplace-assistant",
        "model_version": "tiny v1",
        "messages": [{"role": "system", "content": WORKPLACE_SYSTEM}, *b.messages],
        "tools": WORKPLACE_TOOLS,
        "outcome": "failure",
    }


def small_counts(n: int, causes: list[str]) -> dict[str, int]:
    """`n` failures shared out over `causes` by their shares (largest remainder), each at least one."""
    shares = [SMALL_CAUSES[c][1] for c in causes]
    exact = [n * s / sum(shares) for s in shares]
    counts = [max(1, int(x)) for x in exact]
    by_remainder = sorted(range(len(causes)), key=lambda i: -(exact[i] - int(exact[i])))
    for i in by_remainder[: max(0, n - sum(counts))]:
        counts[i] += 1
    return dict(zip(causes, counts, strict=True))


def small_failures(
    n: int = 40, *, seed: int = 0, prefix: str = "sm", causes: list[str] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """A small project's `n` failures over `causes` (the first four of SMALL_CAUSES by default), in uneven
    shares, shuffled by `seed`: [(cause, record)]."""
    names = causes or list(SMALL_CAUSES)[:4]
    counts = small_counts(n, names)
    out = [(c, small_failure(c, i, seed=seed, prefix=prefix)) for c, k in counts.items() for i in range(k)]
    random.Random(f"small-order:{seed}").shuffle(out)
    return out


def signatures(data: list[tuple[str, dict[str, Any]]]) -> tuple[list[str], list[Any]]:
    """(causes, engine signatures) of labeled records, their signals from the real detectors under the
    default triage policy, as triage would find them."""
    from flywheel.failures.clustering import engine
    from flywheel.trajectories.models import TriagePolicy
    from flywheel.trajectories.triage import detect
    from flywheel.trajectories.triage_policy import DEFAULT_UNSAFE_RULES, policy_spec

    spec = policy_spec(TriagePolicy(pk=1, unsafe=DEFAULT_UNSAFE_RULES, version=1))
    causes, out = [], []
    for cause, record in data:
        found = detect(messages=record["messages"], tools=record["tools"], unsafe_spec=spec, feedback=record.get("feedback"))
        signals = [{"kind": str(s.kind), "message_index": s.message_index, "detail": s.detail} for s in found]
        out.append(engine.signature(record["messages"], signals))
        causes.append(cause)
    return causes, out
