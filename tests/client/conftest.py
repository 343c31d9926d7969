"""Fixtures of the client's tests: a stand-in HTTP server for what we do not run (an OpenAI endpoint, a server
that answers 429), and keys of the live test server's project."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

# A handler gets the request and answers (status, headers, JSON body or None).
Answer = tuple[int, dict[str, str], Any]


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    at: float


@dataclass
class StandIn:
    url: str
    requests: list[Request] = field(default_factory=list)


@pytest.fixture
def stand_in() -> Iterator[Callable[[Callable[[Request], Answer]], StandIn]]:
    """`stand_in(handler) -> StandIn`: an HTTP server on a loopback port answering every request with
    `handler(request)`, and keeping the requests it got."""
    servers: list[ThreadingHTTPServer] = []

    def start(handler: Callable[[Request], Answer]) -> StandIn:
        state = StandIn(url="")

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw
                request = Request(self.command, self.path, dict(self.headers), body, time.monotonic())
                state.requests.append(request)
                status, headers, payload = handler(request)
                data = b"" if payload is None else json.dumps(payload).encode()
                self.send_response(status)
                for name, value in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer  # noqa: N815 (http.server's names)

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        state.url = f"http://127.0.0.1:{server.server_address[1]}"
        return state

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
