"""The reference router: an OpenAI-compatible proxy in front of vLLM that splits traffic between production and
the canary as the platform says, so that every answer names the version that gave it.

    python -m flywheel.router --platform http://flywheel:8000 --key fw_… --upstream http://vllm:8000
                              [--listen 127.0.0.1:8300] [--refresh 10] [--seed N]

(or FLYWHEEL_URL, FLYWHEEL_API_KEY, FLYWHEEL_ROUTER_UPSTREAM). The standard library only, and no Django: it
talks to the platform over HTTP (`GET /api/v1/serving`, a key with scope `read`), so it runs from this file
alone (`python router.py …`) on the serving machine.

What it does, per request:

- `POST /v1/chat/completions` and `POST /v1/completions`: choose an arm, rewrite the body's `model` to that
  arm's adapter name (`<slug>-v<n>`, the name vLLM serves the LoRA under), forward to the upstream, and answer
  the upstream's answer with `model` set to the adapter name (a stream too: each SSE `data:` chunk rewritten),
  plus an `X-Flywheel-Model-Version` header. The agent sends that `model` back as its trajectories'
  `model_version`, so live metrics and the canary decision count each trajectory for the version that answered.
- Which arm: a request whose `model` already names an adapter serving now (production's or the canary's) is
  pinned to it: an agent that sends back the `model` of the first answer keeps one trajectory on one version.
  Any other `model` (the agent's configured name, the base model's, none) is routed by the split: with a sticky
  key (header `X-Flywheel-Route-Key`, else the body's `user`) by a hash of the key, so one key stays on one
  arm while the split stands; without one at random (`--seed` makes the draws repeatable). The canary gets its
  `weight`, production the rest. An adapter that no longer serves (an old version) is routed like any other.
- `GET /v1/models`: the adapters serving now. `GET /healthz`: 200 with the split while production is known,
  else 503 (a load balancer then sends nothing here).

The split is read again every `--refresh` seconds. When the platform cannot be read (down, a refused key, an
answer the router cannot read) the last good split stays in force and the log says so, once per kind of
failure and again when it recovers. With no production (or before the first good read) the routes answer
503 with an OpenAI-style JSON error saying why. The upstream's failures are the router's 502 (refused, cut,
not a JSON object where one was due) or 504 (timed out); its own error answers pass through with their status.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import logging
import os
import random
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger("flywheel.router")

MAX_REQUEST_BYTES = 32 * 1024 * 1024
MAX_ANSWER_BYTES = 64 * 1024 * 1024
MAX_SSE_LINE_BYTES = 8 * 1024 * 1024
PLATFORM_TIMEOUT_S = 10.0
ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions")
# Straight to the platform and the upstream, both on the serving stack's own network: no proxy from the
# environment (an HTTP_PROXY set for the machine's downloads would otherwise carry every completion).
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class SplitUnreadable(Exception):
    """The platform's answer is not a split this router can apply."""


def parse_split(data: Any) -> dict[str, Any]:
    """The split as `GET /api/v1/serving` (and the webhook body) carries it, checked: `{"production": {version,
    adapter, …} | None, "canary": {…, weight} | None}`. Raises SplitUnreadable saying what is wrong."""
    if not isinstance(data, dict) or "production" not in data or "canary" not in data:
        raise SplitUnreadable("not an object with `production` and `canary`")
    out: dict[str, Any] = {"production": None, "canary": None}
    for arm in ("production", "canary"):
        value = data[arm]
        if value is None:
            continue
        if (not isinstance(value, dict) or not isinstance(value.get("adapter"), str) or not value["adapter"]
                or not isinstance(value.get("version"), int) or isinstance(value.get("version"), bool)):
            raise SplitUnreadable(f"`{arm}` has no adapter name and version number")
        out[arm] = {"version": value["version"], "adapter": value["adapter"]}
        if arm == "canary":
            weight = value.get("weight")
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 <= weight <= 1:
                raise SplitUnreadable("the canary's `weight` is not a share between 0 and 1")
            out[arm]["weight"] = float(weight)
    if out["canary"] is not None and out["production"] is None:
        raise SplitUnreadable("a canary without production")
    return out


def describe(split: dict[str, Any] | None) -> str:
    if split is None or split["production"] is None:
        return "no production"
    text = f"production {split['production']['adapter']}"
    if split["canary"] is not None:
        weight = split["canary"]["weight"]
        text = (f"production {split['production']['adapter']} {1 - weight:.0%}, "
                f"canary {split['canary']['adapter']} {weight:.0%}")
    return text


class SplitSource:
    """The last good split read from the platform, and why the last read failed (if it did)."""

    def __init__(self, platform: str, key: str, *, timeout: float = PLATFORM_TIMEOUT_S) -> None:
        self.url = platform.rstrip("/") + "/api/v1/serving"
        self.key = key
        self.timeout = timeout
        self.split: dict[str, Any] | None = None
        self.read_at: float | None = None  # time.time() of the last good read
        self.error: str | None = None
        self._lock = threading.Lock()

    def fetch(self) -> dict[str, Any]:
        request = urllib.request.Request(self.url, headers={"Authorization": f"Bearer {self.key}",
                                                            "Accept": "application/json"})
        try:
            with _OPENER.open(request, timeout=self.timeout) as answer:  # noqa: S310 (the operator's URL)
                raw = answer.read(1024 * 1024 + 1)
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise SplitUnreadable(f"the platform refused the key (HTTP {exc.code}); it needs scope `read`") \
                    from None
            raise SplitUnreadable(f"the platform answered HTTP {exc.code}") from None
        except (OSError, http.client.HTTPException) as exc:
            raise SplitUnreadable(f"the platform is unreachable ({type(exc).__name__}: {exc})") from None
        try:
            data = json.loads(raw)
        except ValueError:
            raise SplitUnreadable("the platform's answer is not JSON") from None
        return parse_split(data)

    def refresh(self) -> bool:
        """Read the split once; keep the last good one when that fails. True when it was read."""
        try:
            split = self.fetch()
        except SplitUnreadable as exc:
            with self._lock:
                first = exc.args[0] != self.error
                self.error = exc.args[0]
                kept = self.split
                since = self.read_at
            if first:
                if kept is None:
                    logger.warning("router: cannot read the split: %s; nothing to route to yet", exc.args[0])
                else:
                    logger.warning("router: cannot read the split: %s; keeping the split read at %s (%s)",
                                   exc.args[0], time.strftime("%H:%M:%S", time.localtime(since)), describe(kept))
            return False
        with self._lock:
            changed = split != self.split
            recovered = self.error is not None
            self.split, self.read_at, self.error = split, time.time(), None
        if recovered:
            logger.info("router: the platform answers again")
        if changed:
            logger.info("router: split now %s", describe(split))
        return True

    def current(self) -> dict[str, Any] | None:
        with self._lock:
            return self.split

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {"split": self.split, "split_age_s": None if self.read_at is None
                    else round(time.time() - self.read_at, 1), "platform_error": self.error}


def sticky_share(key: str) -> float:
    """A key's fixed place in [0, 1): the same key lands on the same arm while the weight stands."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8", "replace")).digest()[:8], "big") / 2**64


class Router:
    """Chooses the arm and forwards; `serve()` runs it on a ThreadingHTTPServer."""

    def __init__(self, source: SplitSource, upstream: str, *, seed: int | None = None,
                 upstream_key: str | None = None, upstream_timeout: float = 600.0) -> None:
        self.source = source
        self.upstream = upstream.rstrip("/")
        self.upstream_key = upstream_key
        self.upstream_timeout = upstream_timeout
        self._random = random.Random(seed)
        self._random_lock = threading.Lock()

    def choose(self, split: dict[str, Any], body: dict[str, Any], route_key: str | None) -> str:
        production, canary = split["production"], split["canary"]
        serving = {production["adapter"]} | ({canary["adapter"]} if canary else set())
        requested = body.get("model")
        if isinstance(requested, str) and requested in serving:
            return requested
        if canary is None:
            return production["adapter"]
        if route_key is None and isinstance(body.get("user"), str) and body["user"]:
            route_key = body["user"]
        if route_key:
            share = sticky_share(route_key)
        else:
            with self._random_lock:
                share = self._random.random()
        return canary["adapter"] if share < canary["weight"] else production["adapter"]


def _error(message: str, kind: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive for the agent; streams go out chunked
    server_version = "flywheel-router"
    router: Router  # set on the subclass serve() makes

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: without this, Nagle's algorithm holds the body until the
        # caller's delayed ACK (40 ms a request on Linux), and a stream's chunks bunch up.
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt: str, *args: Any) -> None:
        logger.debug("router: %s " + fmt, self.address_string(), *args)

    def _json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        split = self.router.source.current()
        if path == "/healthz":
            state = self.router.source.state()
            ok = split is not None and split["production"] is not None
            self._json(200 if ok else 503, {"ok": ok, **state})
        elif path == "/v1/models":
            arms = [] if split is None else [a for a in (split["production"], split["canary"]) if a]
            self._json(200, {"object": "list", "data": [
                {"id": arm["adapter"], "object": "model", "owned_by": "flywheel", "flywheel_version": arm["version"]}
                for arm in arms]})
        else:
            self._json(404, _error(f"No route {path}: this router serves {', '.join(ROUTED_PATHS)}, /v1/models "
                                   "and /healthz.", "not_found", 404))

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > MAX_REQUEST_BYTES:
            self.close_connection = True
            self._json(413 if length > 0 else 400, _error(
                f"The request body must have a Content-Length of at most {MAX_REQUEST_BYTES} bytes.",
                "invalid_request_error", 413 if length > 0 else 400))
            return
        raw = self.rfile.read(length)
        if path not in ROUTED_PATHS:
            self._json(404, _error(f"No route {path}: this router serves {', '.join(ROUTED_PATHS)}.",
                                   "not_found", 404))
            return
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self._json(400, _error("The request body must be a JSON object.", "invalid_request_error", 400))
            return
        split = self.router.source.current()
        if split is None or split["production"] is None:
            state = self.router.source.state()
            why = ("No model is in production in this project yet: there is nothing to route to."
                   if split is not None else "The router has not read the split from the platform yet"
                   + (f" ({state['platform_error']})." if state["platform_error"] else "."))
            self._json(503, _error(why, "no_production", 503), {"Retry-After": "10"})
            return
        adapter = self.router.choose(split, body, self.headers.get("X-Flywheel-Route-Key"))
        body["model"] = adapter
        self._forward(path, json.dumps(body).encode(), adapter)

    def _forward(self, path: str, data: bytes, adapter: str) -> None:
        headers = {"Content-Type": "application/json", "Accept": self.headers.get("Accept") or "*/*"}
        authorization = (f"Bearer {self.router.upstream_key}" if self.router.upstream_key
                         else self.headers.get("Authorization"))
        if authorization:
            headers["Authorization"] = authorization
        request = urllib.request.Request(self.router.upstream + path, data=data, headers=headers, method="POST")
        try:
            answer = _OPENER.open(request, timeout=self.router.upstream_timeout)  # noqa: S310
        except urllib.error.HTTPError as exc:
            answer = exc  # the upstream's own error answer: passed on with its status
        except (OSError, http.client.HTTPException) as exc:
            if isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError):
                self._json(504, _error("The upstream did not answer in time.", "upstream_timeout", 504))
                return
            logger.warning("router: upstream %s failed: %s: %s", self.router.upstream, type(exc).__name__, exc)
            self._json(502, _error(f"The upstream failed ({type(exc).__name__}).", "upstream_error", 502))
            return
        with answer:
            try:
                if (answer.headers.get("Content-Type") or "").startswith("text/event-stream") and answer.status < 300:
                    self._stream(answer, adapter, chunked=self.request_version != "HTTP/1.0")
                else:
                    self._whole(answer, adapter)
            except TimeoutError:
                self._json(504, _error("The upstream did not answer in time.", "upstream_timeout", 504))
            except (OSError, http.client.HTTPException) as exc:
                logger.warning("router: upstream answer cut: %s: %s", type(exc).__name__, exc)
                self._json(502, _error(f"The upstream's answer was cut ({type(exc).__name__}).",
                                       "upstream_error", 502))

    def _whole(self, answer: Any, adapter: str) -> None:
        raw = answer.read(MAX_ANSWER_BYTES + 1)
        if len(raw) > MAX_ANSWER_BYTES:
            self._json(502, _error("The upstream's answer is too large.", "upstream_error", 502))
            return
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            self._json(502, _error(f"The upstream answered HTTP {answer.status} with something that is not a "
                                   "JSON object.", "upstream_error", 502))
            return
        if answer.status < 300 or "model" in payload:
            payload["model"] = adapter
        self._json(answer.status, payload, {"X-Flywheel-Model-Version": adapter})

    def _stream(self, answer: Any, adapter: str, *, chunked: bool) -> None:
        """Server-sent events passed on line by line, each `data:` object's `model` rewritten. A stream the
        upstream cuts is cut here too (no closing chunk), as the agent would have seen it from the upstream.
        An HTTP/1.0 caller gets the stream unchunked, ended by closing the connection."""
        self._chunked = chunked
        self.send_response(answer.status)
        self.send_header("Content-Type", answer.headers.get("Content-Type"))
        self.send_header("Cache-Control", "no-cache")
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.send_header("X-Flywheel-Model-Version", adapter)
        self.end_headers()
        try:
            while True:
                line = answer.readline(MAX_SSE_LINE_BYTES + 1)
                if not line:
                    break
                if len(line) > MAX_SSE_LINE_BYTES:
                    raise ValueError("an event line over the limit")
                self._chunk(_rewrite_event_line(line, adapter))
        except (OSError, http.client.HTTPException, ValueError) as exc:
            logger.warning("router: upstream stream cut: %s: %s", type(exc).__name__, exc)
            self.close_connection = True
            return
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        if self._chunked:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        elif data:
            self.wfile.write(data)
        self.wfile.flush()


def _rewrite_event_line(line: bytes, adapter: str) -> bytes:
    if not line.startswith(b"data:"):
        return line
    content = line[5:].strip()
    try:
        event = json.loads(content)
    except ValueError:
        return line  # [DONE], or what the upstream meant: passed on as it came
    if not isinstance(event, dict):
        return line
    event["model"] = adapter
    ending = b"\r\n" if line.endswith(b"\r\n") else b"\n" if line.endswith(b"\n") else b""
    return b"data: " + json.dumps(event).encode() + ending


class RouterServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], router: Router, refresh_s: float) -> None:
        handler = type("BoundHandler", (Handler,), {"router": router})
        super().__init__(address, handler)
        self.router = router
        self.refresh_s = refresh_s
        self._stop = threading.Event()
        self._refresher = threading.Thread(target=self._refresh_loop, name="router-refresh", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.router.source.refresh()

    def start(self) -> RouterServer:
        """Read the split once, then serve and refresh on threads (tests; `main` serves in the foreground)."""
        self.router.source.refresh()
        self._refresher.start()
        threading.Thread(target=self.serve_forever, name="router-serve", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.shutdown()
        self.server_close()


def build(*, platform: str, key: str, upstream: str, listen: str = "127.0.0.1:8300", refresh_s: float = 10.0,
          seed: int | None = None, upstream_key: str | None = None, upstream_timeout: float = 600.0,
          platform_timeout: float = PLATFORM_TIMEOUT_S) -> RouterServer:
    host, _, port = listen.rpartition(":")
    router = Router(SplitSource(platform, key, timeout=platform_timeout), upstream, seed=seed,
                    upstream_key=upstream_key, upstream_timeout=upstream_timeout)
    return RouterServer((host or "127.0.0.1", int(port)), router, refresh_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flywheel.router", description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", default=os.environ.get("FLYWHEEL_URL"),
                        help="the platform's URL (FLYWHEEL_URL)")
    parser.add_argument("--key", default=os.environ.get("FLYWHEEL_API_KEY"),
                        help="an API key of the project with scope read (FLYWHEEL_API_KEY)")
    parser.add_argument("--upstream", default=os.environ.get("FLYWHEEL_ROUTER_UPSTREAM"),
                        help="the OpenAI-compatible server (vLLM) serving the adapters (FLYWHEEL_ROUTER_UPSTREAM)")
    parser.add_argument("--upstream-key", default=os.environ.get("FLYWHEEL_ROUTER_UPSTREAM_KEY"),
                        help="the upstream's API key (FLYWHEEL_ROUTER_UPSTREAM_KEY); default: the caller's "
                             "Authorization passed on")
    parser.add_argument("--listen", default="127.0.0.1:8300", help="host:port to listen on")
    parser.add_argument("--refresh", type=float, default=10.0, help="seconds between reads of the split")
    parser.add_argument("--seed", type=int, default=None, help="seed of the random draws (tests)")
    parser.add_argument("--upstream-timeout", type=float, default=600.0, help="seconds to wait for the upstream")
    args = parser.parse_args(argv)
    missing = [flag for flag, value in (("--platform", args.platform), ("--key", args.key),
                                        ("--upstream", args.upstream)) if not value]
    if missing:
        parser.error(f"missing {', '.join(missing)} (or its environment variable)")
    if args.refresh <= 0:
        parser.error("--refresh must be above 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    server = build(platform=args.platform, key=args.key, upstream=args.upstream, listen=args.listen,
                   refresh_s=args.refresh, seed=args.seed, upstream_key=args.upstream_key,
                   upstream_timeout=args.upstream_timeout)
    server.router.source.refresh()
    server._refresher.start()
    logger.info("router: listening on %s, forwarding to %s, split from %s every %gs", server.url,
                server.router.upstream, server.router.source.url, args.refresh)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server._stop.set()
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
