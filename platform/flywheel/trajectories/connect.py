"""The "Connect your agent" page (/p/<slug>/connect/): copy-paste snippets that send a team's trajectories
here (REST with curl and Python, a JSONL file, OTLP with the OpenInference and OpenTelemetry GenAI
instrumentors), filled in with this server's address as the request reached it.

The snippets are text templates under templates/trajectories/snippets/, rendered once per page view by
`snippets()`: the page shows that text and its test runs that text, so neither can drift from the other."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.template import Context
from django.template.loader import get_template
from django.urls import reverse
from django.views.decorators.http import require_http_methods

from flywheel.accounts.access import project_view
from flywheel.accounts.models import ApiKey, Project, Role, Scope
from flywheel.accounts.services import hash_api_key

KEY_PLACEHOLDER = "<a key with the ingest scope, from Settings>"


@dataclass(frozen=True)
class Snippet:
    id: str
    language: str  # shell, python, json: what the text is, for the page and for whoever runs it
    text: str


# (id, template, language), in the order the page shows them.
SNIPPETS = (
    ("env", "env.sh", "shell"),
    ("curl", "curl.sh", "shell"),
    ("python", "python.py", "python"),
    ("jsonl_file", "trajectories.jsonl", "json"),
    ("jsonl_curl", "upload.sh", "shell"),
    ("otlp_openinference", "otlp.py", "python"),
    ("otlp_genai", "otlp.py", "python"),
)

# What each OTLP snippet needs installed beside the agent's own `openai`, and how it instruments the client.
INSTRUMENTORS = {
    "otlp_openinference": {
        "packages": ["openinference-instrumentation-openai"],
        "import": "from openinference.instrumentation.openai import OpenAIInstrumentor",
        "setup": "",
    },
    "otlp_genai": {
        "packages": ["opentelemetry-instrumentation-genai-openai"],
        "import": "from opentelemetry.instrumentation.genai.openai import OpenAIInstrumentor",
        # The GenAI instrumentor records no message content unless asked; the platform needs it on the spans.
        "setup": ("# Message content on the spans, where Flywheel reads it (set before the instrumentor loads).\n"
                  'os.environ["OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"] = "span_only"\n'),
    },
}
OTLP_PACKAGES = ["openai", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http"]


def pip_line(snippet_id: str) -> str:
    return "pip install " + " ".join(OTLP_PACKAGES + INSTRUMENTORS[snippet_id]["packages"])


def snippets(*, base_url: str, key: str | None) -> dict[str, Snippet]:
    """Every snippet, by id, for a server at `base_url` (scheme and host, no trailing slash) and `key` (the
    placeholder when None). Values are quoted for the language they land in, never pasted raw."""
    ingest = base_url + reverse("api:trajectories_ingest")
    otlp = base_url + reverse("api:otlp_traces")
    values = {
        "base_url_sh": shlex.quote(base_url),
        "key_sh": shlex.quote(key or KEY_PLACEHOLDER),
        "ingest_url_sh": shlex.quote(ingest),
        "ingest_url_py": json.dumps(ingest),
        "otlp_url_py": json.dumps(otlp),
    }
    out = {}
    for snippet_id, name, language in SNIPPETS:
        context = {**values, **INSTRUMENTORS.get(snippet_id, {})}
        # Autoescape off: this is code, not HTML (the page escapes it when it shows it).
        text = get_template(f"trajectories/snippets/{name}").template.render(Context(context, autoescape=False))
        out[snippet_id] = Snippet(id=snippet_id, language=language, text=text.strip("\n") + "\n")
    return out


def _key_from_request(request: HttpRequest, project: Project) -> tuple[str | None, str]:
    """The key just created (posted from Settings) when it is an active key of this project, and a note.

    The key travels in a POST body, never in a URL: addresses end up in logs and in the browser's history."""
    raw = (request.POST.get("key") or "").strip() if request.method == "POST" else ""
    if not raw:
        return None, ""
    api_key = ApiKey.objects.filter(project=project, digest=hash_api_key(raw), revoked_at__isnull=True).first()
    if api_key is None:
        return None, "That is not an active key of this project: the snippets show a placeholder."
    if Scope.INGEST not in (api_key.scopes or []):
        return raw, f"The key “{api_key.name}” lacks the ingest scope: sending with it gets 403."
    return raw, ""


@require_http_methods(["GET", "POST"])
@project_view()
def connect_page(request: HttpRequest, project: Project) -> HttpResponse:
    key, key_note = _key_from_request(request, project)
    base_url = request.build_absolute_uri("/").rstrip("/")
    context = {
        "project": project,
        "snippets": snippets(base_url=base_url, key=key),
        "key_given": key is not None,
        "key_note": key_note,
        "is_maintainer": request.membership.grants(Role.MAINTAINER),
        "pip_openinference": pip_line("otlp_openinference"),
        "pip_genai": pip_line("otlp_genai"),
        "ingest_url": base_url + reverse("api:trajectories_ingest"),
        "otlp_url": base_url + reverse("api:otlp_traces"),
    }
    response = render(request, "trajectories/connect.html", context)
    if key is not None:
        response["Cache-Control"] = "no-store"  # the page holds a secret
    return response
