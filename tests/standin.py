"""Stand-in HTTP servers for tests of what the platform and the trainer call out to (environment servers,
judges, webhooks): a real socket on 127.0.0.1, a handler that says only what it answers."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class StandIn(BaseHTTPRequestHandler):
    """A handler's shared parts: read the body, answer JSON (or bytes), redirect, and no access log."""

    def body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def answer(self, status: int, payload: Any = None, *, content_type: str = "application/json") -> None:
        data = payload if isinstance(payload, bytes) else json.dumps({} if payload is None else payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def redirect(self, status: int, location: str) -> None:
        self.send_response(status)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler], **attributes: Any) -> Iterator[ThreadingHTTPServer]:
    """The handler served on a free port of 127.0.0.1 until the block ends; `server.url` is its address, and
    each keyword becomes an attribute of the server (what the handler reads as `self.server.<name>`)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    for name, value in attributes.items():
        setattr(server, name, value)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
