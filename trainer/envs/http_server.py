"""Reference environment server: the workplace environment over the HTTP environment protocol.

    python -m trainer.envs.http_server [--host 127.0.0.1] [--port 8765]

prints `{"event": "listening", "url": "http://127.0.0.1:8765"}` on stdout once it accepts requests (with
`--port 0` the system picks the port). A row it serves is a workplace row whose `env.type` is "http":
`{..., "env": {"type": "http", "url": ..., "initial_state": {...}, "max_turns": 4}}`; each session is an
in-process `WorkplaceEnv`, so an episode played through the server gets exactly the rewards it would get
in process. See `trainer.envs.http_env` for the protocol. The server keeps the newest `--max-sessions`
sessions (the oldest go first) and answers a repeated `/step` of a session's last turn from its record.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import uuid
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from trainer.envs.workplace.env import WorkplaceEnv

MAX_REQUEST_BYTES = 16 << 20


class ProtocolError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Session:
    def __init__(self, env: WorkplaceEnv):
        self.env = env
        self.lock = threading.Lock()  # one session's calls apply in order
        self.last: tuple[int, dict[str, Any]] | None = None  # (turn, answer) of the last /step


class WorkplaceServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], max_sessions: int = 10_000):
        super().__init__(address, Handler)
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    # --- the protocol --------------------------------------------------------------------------------
    def reset(self, body: dict[str, Any]) -> dict[str, Any]:
        task = body.get("task")
        if not isinstance(task, dict):
            raise ProtocolError(400, "/reset needs {\"task\": <task row>}")
        env_spec = task.get("env") if isinstance(task.get("env"), dict) else {}
        try:
            env = WorkplaceEnv({**task, "env": {**env_spec, "type": "workplace"}})
        except ValueError as exc:
            raise ProtocolError(400, str(exc)) from None
        sid = uuid.uuid4().hex
        with self.lock:
            self.sessions[sid] = Session(env)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        return {"session_id": sid, "messages": env.reset(), "tools": env.tools}

    def session(self, body: dict[str, Any]) -> Session:
        with self.lock:
            found = self.sessions.get(body.get("session_id"))  # type: ignore[arg-type]
        if found is None:
            raise ProtocolError(404, f"unknown session {body.get('session_id')!r}")
        return found

    def step(self, body: dict[str, Any]) -> dict[str, Any]:
        session = self.session(body)
        turn, message = body.get("turn"), body.get("message")
        if not isinstance(message, dict | str):
            raise ProtocolError(400, "/step needs \"message\": the assistant message")
        with session.lock:
            if session.last is not None and session.last[0] == turn:
                return session.last[1]  # a retried request: answer it again, never apply it twice
            if session.env.done:
                raise ProtocolError(409, "the episode has ended")
            result = session.env.step(message)
            answer = {"observations": [m for m in result.messages if m.get("role") != "assistant"],
                      "done": result.done}
            session.last = (turn, answer)
            return answer

    def verify(self, body: dict[str, Any]) -> dict[str, Any]:
        session = self.session(body)
        with session.lock:
            return session.env.score().to_dict()


class Handler(BaseHTTPRequestHandler):
    server: WorkplaceServer
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 (the name http.server calls)
        routes = {"/reset": self.server.reset, "/step": self.server.step, "/verify": self.server.verify}
        route = routes.get(self.path.rstrip("/"))
        try:
            if route is None:
                raise ProtocolError(404, f"no route {self.path} (POST /reset, /step, /verify)")
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_REQUEST_BYTES:
                raise ProtocolError(413, "request too large")
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except ValueError as exc:
                raise ProtocolError(400, f"the body is not JSON ({exc})") from None
            if not isinstance(body, dict):
                raise ProtocolError(400, "the body must be a JSON object")
            self._send(200, route(body))
        except ProtocolError as exc:
            self._send(exc.status, {"error": str(exc)})
        except Exception as exc:  # noqa: BLE001 (an environment bug is the client's 500, not a dead server)
            self._send(500, {"error": f"{type(exc).__name__}: {exc}"})

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, default=str).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the signature http.server calls)
        pass  # one line per request would drown a training run's stderr


def start(host: str = "127.0.0.1", port: int = 0, max_sessions: int = 10_000) -> WorkplaceServer:
    """A running server in a daemon thread (stop it with `shutdown()` then `server_close()`)."""
    server = WorkplaceServer((host, port), max_sessions)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="workplace-env-server",
                     daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.envs.http_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765, help="0: any free port (printed)")
    parser.add_argument("--max-sessions", type=int, default=10_000)
    args = parser.parse_args(argv)
    server = WorkplaceServer((args.host, args.port), args.max_sessions)
    print(json.dumps({"event": "listening", "url": server.url}), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
