"""Where the trainer may send a request: environment servers, an llm_judge endpoint, a vLLM server.

Private, loopback, link-local and other non-public addresses are refused unless an operator lists the host
or its network (FLYWHEEL_OUTBOUND_ALLOWLIST: hostnames, `*.suffix` names, IP addresses and CIDR networks,
comma separated); public addresses are allowed unless FLYWHEEL_OUTBOUND_PUBLIC is false. The check is on
the resolved address at send time: a name is resolved once, every address it resolves to is checked, and the
connection goes to a checked address (with the name in the Host header and TLS SNI), so a name that answers
differently on a second lookup (DNS rebinding) cannot slip a private address past the check. An IPv6 address
that carries an IPv4 one (IPv4-mapped and -compatible, SIIT, NAT64, 6to4, Teredo) is judged by the IPv4 address
inside it. Redirects are never followed, and a URL with credentials in it (`user:password@host`) is refused:
credentials go in the secret fields, which are bound to the URL's origin.

Every request has one overall deadline (`timeout`): resolving, connecting, sending and reading the whole answer
end by then, however slowly a server trickles its bytes. `redact` and `redact_url` take what may carry a
credential (user and password, query, fragment) out of URLs before they are written into an error or a log.

The platform runs the trainer as a subprocess and passes its settings through those two environment
variables; in the platform's own process `set_policy_source` makes the trainer read the live settings.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

ALLOWLIST_VAR = "FLYWHEEL_OUTBOUND_ALLOWLIST"
PUBLIC_VAR = "FLYWHEEL_OUTBOUND_PUBLIC"
MAX_RESPONSE_BYTES = 16 << 20


class OutboundError(Exception):
    """A request that was not sent: its URL is malformed, its host does not resolve, or the policy refuses it."""


class OutboundRefused(OutboundError):
    """The policy refuses the destination (an address not allowed) or the answer (a redirect)."""


@dataclass(frozen=True)
class Policy:
    """Which destinations are allowed. `hosts` are exact lower-case names or `.suffix` entries (from `*.suffix`)."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = ()
    public: bool = True
    source: str = field(default=ALLOWLIST_VAR, compare=False)

    @classmethod
    def parse(cls, entries: str | Iterable[str], *, public: bool = True, source: str = ALLOWLIST_VAR) -> Policy:
        """From hostnames, `*.suffix` names, IP addresses and CIDR networks (a list, or one comma-separated
        string); a malformed entry raises ValueError naming it."""
        items = entries.replace(",", " ").split() if isinstance(entries, str) else [str(e).strip() for e in entries]
        hosts: set[str] = set()
        networks: list[Network] = []
        for entry in filter(None, items):
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            name = entry.lower().rstrip(".")
            suffix = name.startswith("*.")
            label = name[2:] if suffix else name
            if not label or not all(part and all(c.isalnum() or c == "-" for c in part) for part in label.split(".")):
                raise ValueError(f"{source}: {entry!r} is neither a hostname, an IP address nor a CIDR network")
            hosts.add("." + label if suffix else label)
        return cls(frozenset(hosts), tuple(networks), public, source)

    def lists_host(self, host: str) -> bool:
        name = host.lower().rstrip(".")
        return name in self.hosts or any(h.startswith(".") and name.endswith(h) for h in self.hosts)

    def refusal(self, host: str, address: Address) -> str | None:
        """Why `address` (what `host` resolved to) is refused ("a loopback address, which ... does not list"),
        or None when it is allowed. An IPv6 address that carries an IPv4 one is judged by the IPv4 inside
        (`embedded_ipv4`), unless a listed network holds the IPv6 address itself."""
        if self._listed(host, address):
            return None
        if address.version == 6:
            if address in NAT64_LOCAL:
                return (f"a NAT64 local-use address ({NAT64_LOCAL}), whose IPv4 address cannot be told, which "
                        f"{self.source} does not list")
            for inner in embedded_ipv4(address):
                why = self.refusal(host, inner)
                if why:
                    return f"an IPv6 form of {inner}, {why}"
            if embedded_ipv4(address):
                return None
        if address.is_global and not address.is_multicast:
            if self.public:
                return None
            return f"a public address, and only the hosts and networks {self.source} lists are allowed"
        return f"{_kind(address)} address, which {self.source} does not list"

    def _listed(self, host: str, address: Address) -> bool:
        return self.lists_host(host) or any(address in net for net in self.networks if net.version == address.version)


# The IPv6 prefixes whose addresses carry an IPv4 address in their last 32 bits (RFC 4291 IPv4-compatible and
# IPv4-mapped, RFC 6145 SIIT's IPv4-translated, RFC 6052 NAT64's well-known prefix): a packet to one reaches
# that IPv4 address, or a translator that forwards it there.
_LAST_32 = tuple(ipaddress.IPv6Network(n) for n in ("::/96", "::ffff:0:0/96", "::ffff:0:0:0/96", "64:ff9b::/96"))
# RFC 8215's local-use NAT64 prefix: the IPv4 address sits where the operator's prefix length puts it.
NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")


def embedded_ipv4(address: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 addresses `address` carries, where a packet to it ends up: the last 32 bits under the
    IPv4-compatible, IPv4-mapped, SIIT and NAT64 well-known prefixes, the 6to4 gateway (2002::/16) and both
    Teredo addresses (2001::/32: the server and the client behind it). Empty for any other address."""
    if int(address) <= 1:  # :: and ::1 are IPv6's own unspecified and loopback addresses, judged as such
        return ()
    if any(address in net for net in _LAST_32):
        return (ipaddress.IPv4Address(int(address) & 0xFFFFFFFF),)
    if address.sixtofour is not None:
        return (address.sixtofour,)
    if address.teredo is not None:
        return address.teredo
    return ()


def _kind(address: Address) -> str:
    for kind, test in (("a loopback", "is_loopback"), ("a link-local", "is_link_local"),
                       ("an unspecified", "is_unspecified"), ("a multicast", "is_multicast"),
                       ("a private", "is_private"), ("a reserved", "is_reserved")):
        if getattr(address, test):
            return kind
    return "a non-public"


def env_policy() -> Policy:
    """The policy the platform passed to this process through the environment."""
    public = os.environ.get(PUBLIC_VAR, "true").strip().lower() not in {"0", "false", "no", "off"}
    return Policy.parse(os.environ.get(ALLOWLIST_VAR, ""), public=public)


_policy_source: Callable[[], Policy] = env_policy


def set_policy_source(source: Callable[[], Policy]) -> None:
    """Where `current_policy` reads the policy from (the platform's settings, in the platform's process)."""
    global _policy_source
    _policy_source = source


def current_policy() -> Policy:
    return _policy_source()


@dataclass(frozen=True)
class Target:
    """A URL whose host was resolved and every address checked: connect only to `addresses`."""

    url: str
    scheme: str
    host: str
    port: int
    path: str
    addresses: tuple[Address, ...]


CREDENTIALS_REFUSED = ("a URL may not carry a user name or password (user:password@host): put credentials in "
                      "the secret fields, which are kept sealed and sent only to the origin they were given for")


def check_url(url: str, policy: Policy | None = None, *, deadline: Deadline | None = None) -> Target:
    """Resolve `url`'s host once and check every address; raises OutboundError (OutboundRefused: not allowed),
    or TimeoutError when resolving outlasts `deadline`."""
    policy = policy or current_policy()
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise OutboundError(f"{redact_url(url)!r} is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OutboundError(f"{redact_url(url)!r} must be an http:// or https:// URL with a host")
    if "@" in parts.netloc:
        raise OutboundError(f"{redact_url(url)} refused: {CREDENTIALS_REFUSED}")
    host = parts.hostname
    port = port or (443 if parts.scheme == "https" else 80)
    addresses = resolve(host, port, deadline=deadline)
    for address in addresses:
        why = policy.refusal(host, address)
        if why:
            where = f"{address} is" if _literal(host) else f"{host} resolves to {address},"
            raise OutboundRefused(f"{redact_url(url)} refused: {where} {why}")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(url, parts.scheme, host, port, path, addresses)


def _literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def resolve(host: str, port: int, *, deadline: Deadline | None = None) -> tuple[Address, ...]:
    """Every address `host` resolves to, in the resolver's order (an IP literal is itself)."""
    try:
        return (ipaddress.ip_address(host),)
    except ValueError:
        pass
    try:
        infos = _getaddrinfo(host, port, deadline)
    except (socket.gaierror, UnicodeError) as exc:
        raise OutboundError(f"{host} does not resolve ({exc})") from None
    seen: dict[Address, None] = {}
    for info in infos:
        seen.setdefault(ipaddress.ip_address(info[4][0].split("%", 1)[0]), None)
    if not seen:
        raise OutboundError(f"{host} does not resolve")
    return tuple(seen)


def _getaddrinfo(host: str, port: int, deadline: Deadline | None) -> list[tuple]:
    if deadline is None:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    # The resolver cannot be interrupted: it answers in a thread of its own, and past the deadline it is
    # left to finish there while the request ends.
    answer: dict[str, Any] = {}

    def lookup() -> None:
        try:
            answer["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except BaseException as exc:  # noqa: BLE001 (handed to the caller's thread)
            answer["error"] = exc

    thread = threading.Thread(target=lookup, name="outbound-resolve", daemon=True)
    thread.start()
    thread.join(deadline.left())
    if thread.is_alive():
        raise TimeoutError(f"{host} did not resolve within the request's {deadline.seconds:g} s")
    if "error" in answer:
        raise answer["error"]
    return answer["infos"]


class Deadline:
    """One request's overall deadline. `left()` is the time that remains (TimeoutError once none does), and
    `watch(sock)` shuts the connection down when the deadline passes: a per-read timeout alone lets a server
    that sends one byte a second hold a request open for as long as it likes."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self.expired = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._sock: socket.socket | None = None

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            self.expired = True
            raise TimeoutError(f"no complete answer within {self.seconds:g} s")
        return left

    def watch(self, sock: socket.socket) -> None:
        # A duplicate of the descriptor: shutting it down ends the connection (TLS or not) for every reader,
        # and the number cannot be reused by another socket before `close` (no stray shutdown).
        with self._lock:
            self._sock = sock.dup()
            self._timer = threading.Timer(self.left(), self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            if self._sock is None:
                return
            self.expired = True
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def _connect(addresses: tuple[Address, ...], port: int, deadline: Deadline) -> socket.socket:
    last: OSError | None = None
    for address in addresses:
        try:
            sock = socket.create_connection((str(address), port), timeout=deadline.left())
        except OSError as exc:
            last = exc
            continue
        try:
            deadline.watch(sock)  # before TLS: a handshake trickled byte by byte ends at the deadline too
        except TimeoutError:
            sock.close()
            raise
        return sock
    assert last is not None
    raise last


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to checked addresses only; the Host header still names the host."""

    def __init__(self, target: Target, deadline: Deadline):
        super().__init__(target.host, target.port, timeout=deadline.seconds)
        self._addresses = target.addresses
        self._deadline = deadline

    def connect(self) -> None:
        self.sock = _connect(self._addresses, self.port, self._deadline)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """An HTTPS connection to checked addresses only; the certificate is checked against the host name (SNI)."""

    def __init__(self, target: Target, deadline: Deadline):
        super().__init__(target.host, target.port, timeout=deadline.seconds)
        self._addresses = target.addresses
        self._deadline = deadline

    def connect(self) -> None:
        sock = _connect(self._addresses, self.port, self._deadline)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    headers: dict[str, str]

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def json(self) -> Any:
        return json.loads(self.body)


def request(url: str, *, body: bytes | None = None, headers: dict[str, str] | None = None, method: str = "POST",
            timeout: float = 30.0, policy: Policy | None = None,
            max_bytes: int = MAX_RESPONSE_BYTES) -> Response:
    """Send one request where the policy allows and return the answer, whatever its status.

    `timeout` is the whole request's deadline: resolving, connecting, sending and reading the answer.
    Raises OutboundRefused for a destination not allowed or a redirect (never followed), OutboundError for a
    URL that cannot be sent to, TimeoutError when the deadline passes, and OSError or http.client.HTTPException
    for a failed exchange; no message carries the URL's credentials or query. At most `max_bytes + 1` bytes of
    the answer are read: the caller sees when it was too long."""
    deadline = Deadline(timeout)
    target = check_url(url, policy, deadline=deadline)
    connection = (_PinnedHTTPS if target.scheme == "https" else _PinnedHTTP)(target, deadline)
    try:
        connection.request(method, target.path, body=body, headers=headers or {})
        answer = connection.getresponse()
        data = answer.read(max_bytes + 1)
        deadline.left()  # a read cut short by the deadline is no answer, even where it looks complete
        if 300 <= answer.status < 400:
            location = answer.getheader("Location", "")
            raise OutboundRefused(f"{redact_url(url)} answered HTTP {answer.status} (a redirect to "
                                  f"{redact_url(location) if location else 'nowhere'}); redirects are not followed")
        return Response(answer.status, data, {k.lower(): v for k, v in answer.getheaders()})
    except http.client.InvalidURL:
        # Its message quotes the path and query it refused.
        raise OutboundError(f"{redact_url(url)} is not a URL a request can be sent to") from None
    except (OSError, http.client.HTTPException):
        if deadline.expired:
            raise TimeoutError(f"{redact_url(url)}: no complete answer within {timeout:g} s") from None
        raise
    finally:
        deadline.close()
        connection.close()


def post_json(url: str, payload: Any, *, headers: dict[str, str] | None = None, timeout: float = 30.0,
              policy: Policy | None = None, max_bytes: int = MAX_RESPONSE_BYTES) -> Response:
    data = json.dumps(payload, ensure_ascii=False, default=str).encode()
    return request(url, body=data, headers={"Content-Type": "application/json", **(headers or {})},
                   timeout=timeout, policy=policy, max_bytes=max_bytes)


_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def redact_url(url: str) -> str:
    """`url` as it may be shown or logged: scheme, host, port and path, without the user and password, the
    query or the fragment (where credentials and tokens ride)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(a malformed URL)"
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def redact(text: str) -> str:
    """`text` (an exception's message, an error to store) with every URL in it passed through `redact_url`."""

    def one(match: re.Match) -> str:
        url = match.group(0)
        bare = url.rstrip(".,;:)")  # the sentence's punctuation, not the URL's
        return redact_url(bare) + url[len(bare):]

    return _URL_IN_TEXT.sub(one, text)
