"""Where the trainer may send a request: environment servers, an llm_judge endpoint, a vLLM server.

Private, loopback, link-local and other non-public addresses are refused unless an operator lists the host
or its network (FLYWHEEL_OUTBOUND_ALLOWLIST: hostnames, `*.suffix` names, IP addresses and CIDR networks,
comma separated); public addresses are allowed unless FLYWHEEL_OUTBOUND_PUBLIC is false. The check is on
the resolved address at send time: a name is resolved once, every address it resolves to is checked, and the
connection goes to a checked address (with the name in the Host header and TLS SNI), so a name that answers
differently on a second lookup (DNS rebinding) cannot slip a private address past the check. Redirects are
never followed.

The platform runs the trainer as a subprocess and passes its settings through those two environment
variables; in the platform's own process `set_policy_source` makes the trainer read the live settings.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

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
        or None when it is allowed."""
        if address.version == 6 and address.ipv4_mapped:  # ::ffff:127.0.0.1 is 127.0.0.1
            address = address.ipv4_mapped
        if any(address in net for net in self.networks if net.version == address.version):
            return None
        if self.lists_host(host):
            return None
        if address.is_global and not address.is_multicast:
            if self.public:
                return None
            return f"a public address, and only the hosts and networks {self.source} lists are allowed"
        return f"{_kind(address)} address, which {self.source} does not list"


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


def check_url(url: str, policy: Policy | None = None) -> Target:
    """Resolve `url`'s host once and check every address; raises OutboundError (OutboundRefused: not allowed)."""
    policy = policy or current_policy()
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise OutboundError(f"{url!r} is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OutboundError(f"{url!r} must be an http:// or https:// URL with a host")
    host = parts.hostname
    port = port or (443 if parts.scheme == "https" else 80)
    addresses = resolve(host, port)
    for address in addresses:
        why = policy.refusal(host, address)
        if why:
            where = f"{address} is" if _literal(host) else f"{host} resolves to {address},"
            raise OutboundRefused(f"{url} refused: {where} {why}")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(url, parts.scheme, host, port, path, addresses)


def _literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def resolve(host: str, port: int) -> tuple[Address, ...]:
    """Every address `host` resolves to, in the resolver's order (an IP literal is itself)."""
    try:
        return (ipaddress.ip_address(host),)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise OutboundError(f"{host} does not resolve ({exc})") from None
    seen: dict[Address, None] = {}
    for info in infos:
        seen.setdefault(ipaddress.ip_address(info[4][0].split("%", 1)[0]), None)
    if not seen:
        raise OutboundError(f"{host} does not resolve")
    return tuple(seen)


def _connect(addresses: tuple[Address, ...], port: int, timeout: float | None) -> socket.socket:
    last: OSError | None = None
    for address in addresses:
        try:
            return socket.create_connection((str(address), port), timeout=timeout)
        except OSError as exc:
            last = exc
    assert last is not None
    raise last


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to checked addresses only; the Host header still names the host."""

    def __init__(self, target: Target, timeout: float):
        super().__init__(target.host, target.port, timeout=timeout)
        self._addresses = target.addresses

    def connect(self) -> None:
        self.sock = _connect(self._addresses, self.port, self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """An HTTPS connection to checked addresses only; the certificate is checked against the host name (SNI)."""

    def __init__(self, target: Target, timeout: float):
        super().__init__(target.host, target.port, timeout=timeout)
        self._addresses = target.addresses

    def connect(self) -> None:
        sock = _connect(self._addresses, self.port, self.timeout)
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

    Raises OutboundRefused for a destination not allowed or a redirect (never followed), OutboundError for a
    URL that cannot be sent to, and OSError (timeouts included) or http.client.HTTPException for a failed
    exchange. At most `max_bytes + 1` bytes of the answer are read: the caller sees when it was too long."""
    target = check_url(url, policy)
    connection = (_PinnedHTTPS if target.scheme == "https" else _PinnedHTTP)(target, timeout)
    try:
        connection.request(method, target.path, body=body, headers=headers or {})
        answer = connection.getresponse()
        data = answer.read(max_bytes + 1)
        if 300 <= answer.status < 400:
            location = answer.getheader("Location", "")
            raise OutboundRefused(f"{url} answered HTTP {answer.status} (a redirect to {location or 'nowhere'}); "
                                  "redirects are not followed")
        return Response(answer.status, data, {k.lower(): v for k, v in answer.getheaders()})
    finally:
        connection.close()


def post_json(url: str, payload: Any, *, headers: dict[str, str] | None = None, timeout: float = 30.0,
              policy: Policy | None = None, max_bytes: int = MAX_RESPONSE_BYTES) -> Response:
    data = json.dumps(payload, ensure_ascii=False, default=str).encode()
    return request(url, body=data, headers={"Content-Type": "application/json", **(headers or {})},
                   timeout=timeout, policy=policy, max_bytes=max_bytes)
