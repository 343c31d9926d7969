"""Optional cluster names from an OpenAI-compatible endpoint (a local HTTP server here, the boundary we do not
own): off by default, used when on, and a failing endpoint keeps the keyword label."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from flywheel.failures.clustering import services
from trainer.verifiers import configure_llm_judge


@pytest.fixture
def endpoint():
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
            if "get_stock_price" not in body["messages"][0]["content"]:
                self.send_response(500)
                self.end_headers()
                return
            reply = {"choices": [{"message": {"role": "assistant", "content": '"Stock quote lookups time out."'}}]}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    configure_llm_judge(endpoint=f"http://127.0.0.1:{server.server_port}/v1", model="namer", api_key="k")
    yield seen
    configure_llm_judge(endpoint=None)
    server.shutdown()


def test_naming_is_off_by_default_and_names_groups_when_on(db, embedder, project, user, labeled_failures, endpoint, settings):
    labeled_failures(project, 10, ["stock_timeout", "sql_syntax_error"])
    run = services.clustering_run_process(run_id=services.clustering_run_start(project=project, user=user).pk)
    assert endpoint == [] and not any(s.label.startswith("Stock quote") for s in run.suggestions.all())

    settings.FLYWHEEL_CLUSTER_NAMING = True
    run = services.clustering_run_process(run_id=services.clustering_run_start(project=project, user=user).pk)
    labels = sorted(s.label for s in run.suggestions.all())
    assert run.status == "done" and len(endpoint) == 2
    assert endpoint[0]["path"] == "/v1/chat/completions" and endpoint[0]["auth"] == "Bearer k"
    assert endpoint[0]["body"]["model"] == "namer"
    assert "Stock quote lookups time out" in labels  # named
    assert any(label.startswith("run_sql") for label in labels)  # the endpoint failed: the keyword label stays
