"""The reference router: an OpenAI-compatible proxy in front of vLLM that splits traffic between production and
the canary as the platform says, so that every answer names the version that gave it, and vouches for it.

    python -m flywheel.router --platform http://flywheel:8000 --key fw_… --upstream http://vllm:8000
                              [--listen 127.0.0.1:8300] [--inbound-key …] [--refresh 10] [--seed N]

(or FLYWHEEL_URL, FLYWHEEL_API_KEY, FLYWHEEL_ROUTER_UPSTREAM, FLYWHEEL_ROUTER_INBOUND_KEY). The standard library
only, and no Django: it talks to the platform over HTTP (`GET /api/v1/serving`, a key with scope `read`, and
`GET /api/v1/serving/evidence-key` with scope `route`), so it runs from this file alone (`python router.py …`)
on the serving machine.

Who may ask. With `--inbound-key`, only a caller that sends that key (`Authorization: Bearer KEY`, what an OpenAI
client sends as its api_key); anyone else gets 401. That key is the router's own and never goes on to the
upstream, which gets `--upstream-key` or no key. Without `--inbound-key` the router listens on a loopback address
only (unless `--allow-anonymous`) and passes the caller's Authorization on, and it refuses `--upstream-key`: the
upstream's key is never lent to whoever can reach the port. At most `--max-connections` connections are served at
once (a thread each; one over the bound is answered 503 at once), a request body needs a Content-Length of at
most `--max-request-bytes`, and a caller silent for `--client-timeout` seconds is hung up on.

What it does, per request:

- `POST /v1/chat/completions` and `POST /v1/completions`: choose an arm, rewrite the body's `model` to that
  arm's adapter name (`<slug>-v<n>`, the name vLLM serves the LoRA under), forward to the upstream, and answer
  the upstream's answer with `model` set to the adapter name (a stream too: each SSE `data:` chunk rewritten),
  plus an `X-Flywheel-Model-Version` header. The agent sends that `model` back as its trajectories'
  `model_version`, so live metrics and the canary decision count each trajectory for the version that answered.
- Which arm: the split's. With a sticky key (header `X-Flywheel-Route-Key`, else the body's `user`) by a keyed
  hash of the key (HMAC under the project's evidence key, so which keys land on the canary cannot be worked out
  offline), so one key stays on one arm while the split stands; without one at random (`--seed` makes the draws
  repeatable). The canary gets its `weight`; during the watch of a new production the version it
  replaced keeps the holdback's `weight` (the watch's concurrent comparison); production gets the rest. A request whose `model` names an adapter
  serving now is answered by it only when the split assigned it that adapter (its route key's arm, or the only
  adapter while no canary serves); naming another is 403, unless the router runs with `--allow-pinning` (then
  it is pinned, and its answer carries no evidence token). Any other `model` (the agent's configured name, the
  base model's, an adapter that no longer serves, none) is routed by the split.
- Evidence: every successful answer routed by the split carries a token, in the `X-Flywheel-Evidence` header and,
  in a JSON answer, as `flywheel.evidence` in the body: `fw1.<version>.<unix time>.<request id>.<mac>`, the MAC
  HMAC-SHA256 under the project's evidence key (`evidence_sign`). The agent's trajectory carries it back in
  `metadata.flywheel_evidence` (`flywheel_client.wrap` copies it), the platform checks it at ingestion, and only
  trajectories it vouches for can move the canary or the watch by themselves. Without a key of scope `route`
  the router routes as well but vouches for nothing.
- `GET /v1/models`: the adapters serving now. `GET /healthz`: 200 with the split while production is known,
  else 503 (a load balancer then sends nothing here); to a caller without the inbound key, only `ok`.

The split and the evidence key are read again every `--refresh` seconds. When the platform cannot be read
(down, a refused key, an answer the router cannot read) the last good split stays in force and the log says so,
once per kind of failure and again when it recovers. With no production (or before the first good read) the
routes answer 503 with an OpenAI-style JSON error saying why. The upstream's failures are the router's 502
(refused, cut, not a JSON object where one was due) or 504 (timed out); its own error answers pass through with
their status.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import http.client
import ipaddress
import json
import logging
import os
import random
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

logger = logging.getLogger("flywheel.router")

MAX_REQUEST_BYTES = 8 * 1024 * 1024  # default of --max-request-bytes
MAX_CONNECTIONS = 128  # default of --max-connections
CLIENT_TIMEOUT_S = 60.0  # default of --client-timeout
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
    adapter, …} | None, "canary": {…, weight} | None, "holdback": {…, weight} | None}` (a platform that predates
    the holdback sends none). Raises SplitUnreadable saying what is wrong."""
    if not isinstance(data, dict) or "production" not in data or "canary" not in data:
        raise SplitUnreadable("not an object with `production` and `canary`")
    out: dict[str, Any] = {"production": None, "canary": None, "holdback": None}
    for arm in ("production", "canary", "holdback"):
        value = data.get(arm)
        if value is None:
            continue
        if (not isinstance(value, dict) or not isinstance(value.get("adapter"), str) or not value["adapter"]
                or not isinstance(value.get("version"), int) or isinstance(value.get("version"), bool)):
            raise SplitUnreadable(f"`{arm}` has no adapter name and version number")
        out[arm] = {"version": value["version"], "adapter": value["adapter"]}
        if arm != "production":
            weight = value.get("weight")
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 <= weight <= 1:
                raise SplitUnreadable(f"the {arm}'s `weight` is not a share between 0 and 1")
            out[arm]["weight"] = float(weight)
    if (out["canary"] is not None or out["holdback"] is not None) and out["production"] is None:
        raise SplitUnreadable("a canary or a holdback without production")
    if sum(out[arm]["weight"] for arm in ("canary", "holdback") if out[arm]) > 1:
        raise SplitUnreadable("the canary's and the holdback's weights add up to more than all traffic")
    return out


def describe(split: dict[str, Any] | None) -> str:
    if split is None or split["production"] is None:
        return "no production"
    others = [(arm, split[arm]) for arm in ("canary", "holdback") if split.get(arm) is not None]
    if not others:
        return f"production {split['production']['adapter']}"
    rest = 1 - sum(value["weight"] for _, value in others)
    return ", ".join([f"production {split['production']['adapter']} {rest:.0%}",
                      *(f"{arm} {value['adapter']} {value['weight']:.0%}" for arm, value in others)])


# --- evidence -----------------------------------------------------------------------------------------------------
# The token format is owned here, by the signer; the platform reads tokens with these same functions
# (flywheel.trajectories.vouch), under keys it derives itself.

EVIDENCE_FORMAT = "fw1"
EVIDENCE_MAX_CHARS = 200
_REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")
_MAC = re.compile(r"[A-Za-z0-9_-]{43}")


def _digits(text: str, most: int) -> bool:
    return text.isascii() and text.isdigit() and 0 < len(text) <= most and (text == "0" or text[0] != "0")


class Evidence(NamedTuple):
    """A token's fields: which version answered, when (Unix seconds), the request's own id, and the MAC."""

    version: int
    at: int
    request_id: str
    mac: str

    def signed_by(self, key: bytes) -> bool:
        expected = _mac(key, self.version, self.at, self.request_id)
        return hmac.compare_digest(expected.encode(), self.mac.encode())


def _mac(key: bytes, version: int, at: int, request_id: str) -> str:
    message = f"{EVIDENCE_FORMAT}.{version}.{at}.{request_id}".encode()
    return base64.urlsafe_b64encode(hmac.new(key, message, hashlib.sha256).digest()).rstrip(b"=").decode()


def evidence_sign(key: bytes, *, version: int, at: int, request_id: str) -> str:
    """The token that vouches that `version` answered request `request_id` at `at`:
    `fw1.<version>.<at>.<request_id>.<base64url HMAC-SHA256 of what precedes the MAC>`."""
    return f"{EVIDENCE_FORMAT}.{version}.{at}.{request_id}.{_mac(key, version, at, request_id)}"


def evidence_parse(token: Any) -> Evidence | None:
    """The token's fields, or None when it is not a token of this format (its MAC is not checked here)."""
    if not isinstance(token, str) or len(token) > EVIDENCE_MAX_CHARS:
        return None
    parts = token.split(".")
    if len(parts) != 5 or parts[0] != EVIDENCE_FORMAT:
        return None
    _, version, at, request_id, mac = parts
    if not (_digits(version, 9) and version != "0" and _digits(at, 12) and _REQUEST_ID.fullmatch(request_id)
            and _MAC.fullmatch(mac)):
        return None
    return Evidence(version=int(version), at=int(at), request_id=request_id, mac=mac)


def sticky_share(key: str, secret: bytes) -> float:
    """A route key's fixed place in [0, 1): the same key lands on the same arm while the weight stands. Keyed by
    `secret`, so that nobody without it can work out offline which keys land on the canary."""
    digest = hmac.new(secret, b"route:" + key.encode("utf-8", "replace"), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def arm_for(split: dict[str, Any], share: float) -> dict[str, Any]:
    """The arm of a request whose share (uniform on [0, 1): a route key's `sticky_share` or a random draw) is
    `share`: the canary's weight first, then the holdback's (the replaced version during a watch), production the
    rest."""
    edge = 0.0
    for name in ("canary", "holdback"):
        arm = split.get(name)
        if arm is not None:
            edge += arm["weight"]
            if share < edge:
                return arm
    return split["production"]


class SplitSource:
    """The last good split read from the platform, and why the last read failed (if it did)."""

    def __init__(self, platform: str, key: str, *, timeout: float = PLATFORM_TIMEOUT_S) -> None:
        self.url = platform.rstrip("/") + "/api/v1/serving"
        self.key_url = self.url + "/evidence-key"
        self.key = key
        self.timeout = timeout
        self.split: dict[str, Any] | None = None
        self.read_at: float | None = None  # time.time() of the last good read
        self.error: str | None = None
        self._evidence_key: bytes | None = None
        self.evidence_error: str | None = None
        self._lock = threading.Lock()

    def _get(self, url: str, scope: str) -> Any:
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.key}",
                                                       "Accept": "application/json"})
        try:
            with _OPENER.open(request, timeout=self.timeout) as answer:  # noqa: S310 (the operator's URL)
                raw = answer.read(1024 * 1024 + 1)
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise SplitUnreadable(f"the platform refused the key (HTTP {exc.code}); it needs scope `{scope}`") \
                    from None
            raise SplitUnreadable(f"the platform answered HTTP {exc.code}") from None
        except (OSError, http.client.HTTPException) as exc:
            raise SplitUnreadable(f"the platform is unreachable ({type(exc).__name__}: {exc})") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise SplitUnreadable("the platform's answer is not JSON") from None

    def fetch(self) -> dict[str, Any]:
        return parse_split(self._get(self.url, "read"))

    def fetch_evidence_key(self) -> bytes:
        data = self._get(self.key_url, "route")
        raw = data.get("key") if isinstance(data, dict) else None
        try:
            key = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)) if isinstance(raw, str) else b""
        except ValueError:
            key = b""
        if len(key) < 32:
            raise SplitUnreadable("the platform's evidence key is not a base64url key of 32 bytes or more")
        return key

    def evidence_key(self) -> bytes | None:
        with self._lock:
            return self._evidence_key

    def _refresh_evidence_key(self) -> None:
        """Read the key the answers are vouched with; keep the last good one when that fails, and say once."""
        try:
            key = self.fetch_evidence_key()
        except SplitUnreadable as exc:
            with self._lock:
                first = exc.args[0] != self.evidence_error
                self.evidence_error = exc.args[0]
                held = self._evidence_key is not None
            if first:
                logger.warning("router: cannot read the evidence key: %s; %s", exc.args[0],
                               "keeping the last one" if held else "answers carry no evidence token, so the "
                               "canary and the watch cannot act on this traffic by themselves")
            return
        with self._lock:
            changed, recovered = key != self._evidence_key, self.evidence_error is not None
            self._evidence_key, self.evidence_error = key, None
        if changed or recovered:
            logger.info("router: evidence key read; answers routed by the split carry an evidence token")

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
        self._refresh_evidence_key()
        return True

    def current(self) -> dict[str, Any] | None:
        with self._lock:
            return self.split

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {"split": self.split, "split_age_s": None if self.read_at is None
                    else round(time.time() - self.read_at, 1), "platform_error": self.error,
                    "vouches": self._evidence_key is not None, "evidence_error": self.evidence_error}


class NotAssigned(Exception):
    """A request names a serving adapter the split did not assign it."""


class Router:
    """Chooses the arm, vouches for the answer and forwards; `serve()` runs it on a ThreadingHTTPServer."""

    def __init__(self, source: SplitSource, upstream: str, *, seed: int | None = None,
                 upstream_key: str | None = None, upstream_timeout: float = 600.0, inbound_key: str | None = None,
                 allow_pinning: bool = False, max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        if upstream_key and not inbound_key:
            raise ValueError("--upstream-key needs --inbound-key: without it, anyone who reaches the router "
                             "would use the upstream's key")
        self.source = source
        self.upstream = upstream.rstrip("/")
        self.upstream_key = upstream_key
        self.upstream_timeout = upstream_timeout
        self.inbound_key = inbound_key or None
        self.allow_pinning = allow_pinning
        self.max_request_bytes = max_request_bytes
        self._random = random.Random(seed)
        self._random_lock = threading.Lock()
        # Until the platform gives the evidence key, route keys hash under a secret of this process: still not
        # computable offline, but sticky within this process only.
        self._own_secret = os.urandom(32)

    def caller_allowed(self, authorization: str | None) -> bool:
        if self.inbound_key is None:
            return True
        scheme, _, given = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.inbound_key.encode())

    def choose(self, split: dict[str, Any], body: dict[str, Any], route_key: str | None) -> tuple[dict[str, Any], bool]:
        """(the arm that answers, whether the caller pinned it rather than the split choosing it). NotAssigned
        when `model` names a serving adapter the split did not assign this request and pinning is not allowed."""
        production = split["production"]
        # The canary's share first, then the holdback's (the replaced version during a watch), production the rest.
        others = [split[arm] for arm in ("canary", "holdback") if split.get(arm) is not None]
        arms = {arm["adapter"]: arm for arm in (production, *others)}
        if route_key is None and isinstance(body.get("user"), str) and body["user"]:
            route_key = body["user"]
        assigned = production
        if others:
            if route_key:
                share = sticky_share(route_key, self.source.evidence_key() or self._own_secret)
            else:
                with self._random_lock:
                    share = self._random.random()
            assigned = arm_for(split, share)
        requested = body.get("model")
        if isinstance(requested, str) and requested in arms:
            # Without a route key a request has no assignment to name: only the sole adapter is its own.
            named_assigned = requested == assigned["adapter"] and (not others or bool(route_key))
            if not named_assigned:
                if not self.allow_pinning:
                    raise NotAssigned(requested)
                return arms[requested], True
        return assigned, False

    def evidence_for(self, arm: dict[str, Any]) -> str | None:
        key = self.source.evidence_key()
        if key is None:
            return None
        return evidence_sign(key, version=arm["version"], at=int(time.time()), request_id=uuid.uuid4().hex)


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

    def _caller_allowed(self) -> bool:
        """Whether the caller sent the inbound key (always, without one); answers 401 when not."""
        if self.router.caller_allowed(self.headers.get("Authorization")):
            return True
        self._json(401, _error("Send the router's key: Authorization: Bearer KEY.", "invalid_api_key", 401),
                   {"WWW-Authenticate": "Bearer"})
        return False

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        split = self.router.source.current()
        if path == "/healthz":
            ok = split is not None and split["production"] is not None
            known = self.router.caller_allowed(self.headers.get("Authorization"))
            self._json(200 if ok else 503, {"ok": ok, **(self.router.source.state() if known else {})})
        elif not self._caller_allowed():
            return
        elif path == "/v1/models":
            arms = [] if split is None else [a for a in (split["production"], split["canary"], split["holdback"]) if a]
            self._json(200, {"object": "list", "data": [
                {"id": arm["adapter"], "object": "model", "owned_by": "flywheel", "flywheel_version": arm["version"]}
                for arm in arms]})
        else:
            self._json(404, _error(f"No route {path}: this router serves {', '.join(ROUTED_PATHS)}, /v1/models "
                                   "and /healthz.", "not_found", 404))

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        if not self._caller_allowed():
            self.close_connection = True  # its body, if any, is not read
            return
        limit = self.router.max_request_bytes
        declared = self.headers.get("Content-Length")
        try:
            length = int(declared) if declared is not None else -1
        except ValueError:
            length = -1
        if self.headers.get("Transfer-Encoding") or length < 0 or length > limit:
            # Not read: a body of unknown or excessive size is refused before a byte of it is held.
            self.close_connection = True
            status = 413 if length > limit else 411
            self._json(status, _error(f"The request body must have a Content-Length of at most {limit} bytes.",
                                      "invalid_request_error", status))
            return
        try:
            raw = self.rfile.read(length)
        except OSError:  # the caller went silent past --client-timeout, or hung up
            self.close_connection = True
            return
        if len(raw) < length:
            self.close_connection = True
            return
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
        try:
            arm, pinned = self.router.choose(split, body, self.headers.get("X-Flywheel-Route-Key"))
        except NotAssigned as exc:
            self._json(403, _error(
                f"`model` names {exc.args[0]}, a version this request was not assigned: the router chooses the "
                "version. Send your agent's own model name; to keep a conversation on one version, send the same "
                "X-Flywheel-Route-Key (or `user`) with each of its requests.", "version_not_assigned", 403))
            return
        body["model"] = arm["adapter"]
        # A pinned answer is the caller's choice, not the split's: it vouches for nothing.
        token = None if pinned else self.router.evidence_for(arm)
        self._forward(path, json.dumps(body).encode(), arm, token)

    def _forward(self, path: str, data: bytes, arm: dict[str, Any], token: str | None) -> None:
        adapter = arm["adapter"]
        headers = {"Content-Type": "application/json", "Accept": self.headers.get("Accept") or "*/*"}
        # The caller's Authorization goes on only when it is not the router's own key.
        authorization = (f"Bearer {self.router.upstream_key}" if self.router.upstream_key
                         else None if self.router.inbound_key else self.headers.get("Authorization"))
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
                    self._stream(answer, adapter, token, chunked=self.request_version != "HTTP/1.0")
                else:
                    self._whole(answer, arm, token)
            except TimeoutError:
                self._json(504, _error("The upstream did not answer in time.", "upstream_timeout", 504))
            except (OSError, http.client.HTTPException) as exc:
                logger.warning("router: upstream answer cut: %s: %s", type(exc).__name__, exc)
                self._json(502, _error(f"The upstream's answer was cut ({type(exc).__name__}).",
                                       "upstream_error", 502))

    def _whole(self, answer: Any, arm: dict[str, Any], token: str | None) -> None:
        adapter = arm["adapter"]
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
        headers = {"X-Flywheel-Model-Version": adapter}
        if token and answer.status < 300:
            payload["flywheel"] = {"version": arm["version"], "evidence": token}
            headers["X-Flywheel-Evidence"] = token
        self._json(answer.status, payload, headers)

    def _stream(self, answer: Any, adapter: str, token: str | None, *, chunked: bool) -> None:
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
        if token:
            self.send_header("X-Flywheel-Evidence", token)
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


_BUSY = json.dumps(_error("The router serves as many connections as it may at once; try again.",
                          "server_busy", 503)).encode()


class RouterServer(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` of them: one over the bound is answered 503 by the
    accepting thread and closed, so a flood of connections costs neither threads nor memory beyond the bound."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], router: Router, refresh_s: float, *,
                 max_connections: int = MAX_CONNECTIONS, client_timeout: float = CLIENT_TIMEOUT_S) -> None:
        # StreamRequestHandler puts `timeout` on the connection's socket: a caller silent that long is hung up on.
        handler = type("BoundHandler", (Handler,), {"router": router, "timeout": client_timeout})
        super().__init__(address, handler)
        self.router = router
        self.refresh_s = refresh_s
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._stop = threading.Event()
        self._refresher = threading.Thread(target=self._refresh_loop, name="router-refresh", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                                % (len(_BUSY), _BUSY))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        # ThreadingMixIn's, with the slot given back before the connection is closed, not after: a caller that
        # sees the close and connects again at once finds its slot free (after, it could still be refused 503).
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self._slots.release()
            self.shutdown_request(request)

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


def _loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build(*, platform: str, key: str, upstream: str, listen: str = "127.0.0.1:8300", refresh_s: float = 10.0,
          seed: int | None = None, upstream_key: str | None = None, upstream_timeout: float = 600.0,
          platform_timeout: float = PLATFORM_TIMEOUT_S, inbound_key: str | None = None,
          allow_anonymous: bool = False, allow_pinning: bool = False, max_connections: int = MAX_CONNECTIONS,
          max_request_bytes: int = MAX_REQUEST_BYTES, client_timeout: float = CLIENT_TIMEOUT_S) -> RouterServer:
    """The router, not yet serving. ValueError when the options would open it to anyone: `upstream_key` without
    `inbound_key`, or an address other than loopback without `inbound_key` (unless `allow_anonymous`)."""
    host, _, port = listen.rpartition(":")
    host = host or "127.0.0.1"
    if not inbound_key and not allow_anonymous and not _loopback(host):
        raise ValueError(f"--listen {listen} without --inbound-key would serve anyone who reaches the port: set "
                         "--inbound-key (or --allow-anonymous behind a boundary that checks callers)")
    if max_connections < 1 or max_request_bytes < 1 or client_timeout <= 0:
        raise ValueError("--max-connections, --max-request-bytes and --client-timeout must be above 0")
    router = Router(SplitSource(platform, key, timeout=platform_timeout), upstream, seed=seed,
                    upstream_key=upstream_key, upstream_timeout=upstream_timeout, inbound_key=inbound_key,
                    allow_pinning=allow_pinning, max_request_bytes=max_request_bytes)
    return RouterServer((host, int(port)), router, refresh_s, max_connections=max_connections,
                        client_timeout=client_timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flywheel.router", description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", default=os.environ.get("FLYWHEEL_URL"),
                        help="the platform's URL (FLYWHEEL_URL)")
    parser.add_argument("--key", default=os.environ.get("FLYWHEEL_API_KEY"),
                        help="an API key of the project with scopes read and route (FLYWHEEL_API_KEY); without "
                             "route it routes but vouches for nothing")
    parser.add_argument("--upstream", default=os.environ.get("FLYWHEEL_ROUTER_UPSTREAM"),
                        help="the OpenAI-compatible server (vLLM) serving the adapters (FLYWHEEL_ROUTER_UPSTREAM)")
    parser.add_argument("--upstream-key", default=os.environ.get("FLYWHEEL_ROUTER_UPSTREAM_KEY"),
                        help="the upstream's API key (FLYWHEEL_ROUTER_UPSTREAM_KEY); needs --inbound-key. Default: "
                             "the caller's Authorization passed on (none with --inbound-key)")
    parser.add_argument("--inbound-key", default=os.environ.get("FLYWHEEL_ROUTER_INBOUND_KEY"),
                        help="the key callers must send as `Authorization: Bearer KEY` (FLYWHEEL_ROUTER_INBOUND_KEY); "
                             "required to listen on an address other than loopback")
    parser.add_argument("--allow-anonymous", action="store_true",
                        help="listen on an address other than loopback without --inbound-key (only behind a "
                             "boundary that checks callers)")
    parser.add_argument("--allow-pinning", action="store_true",
                        help="answer a request that names a serving adapter it was not assigned with that adapter "
                             "(its answer carries no evidence token) instead of 403")
    parser.add_argument("--listen", default="127.0.0.1:8300", help="host:port to listen on")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                        help="connections served at once (a thread each); more are answered 503")
    parser.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                        help="largest request body (its Content-Length); larger is 413. Memory held by requests is "
                             "at most this times --max-connections")
    parser.add_argument("--client-timeout", type=float, default=CLIENT_TIMEOUT_S,
                        help="seconds a caller may stay silent (while sending its request, or between requests on "
                             "a kept-alive connection) before it is hung up on")
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
    try:
        server = build(platform=args.platform, key=args.key, upstream=args.upstream, listen=args.listen,
                       refresh_s=args.refresh, seed=args.seed, upstream_key=args.upstream_key,
                       upstream_timeout=args.upstream_timeout, inbound_key=args.inbound_key,
                       allow_anonymous=args.allow_anonymous, allow_pinning=args.allow_pinning,
                       max_connections=args.max_connections, max_request_bytes=args.max_request_bytes,
                       client_timeout=args.client_timeout)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
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
