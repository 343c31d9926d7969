"""Where the platform may send requests (flywheel.outbound): only to destinations the operator's settings
allow, checked on the resolved address at send time, never following a redirect.

Real sockets against stand-in servers on 127.0.0.1; the resolver is replaced only to make a name answer what
a hostile DNS server would (the boundary we do not own)."""

from __future__ import annotations

import socket
from contextlib import ExitStack

import pytest
from django.urls import reverse

from flywheel import outbound
from flywheel.registry import services
from flywheel.registry.models import AliasEvent, GateDecision, RegistrySettings, SyncState
from tests.standin import StandIn, serving
from trainer import outbound as guard


class _Server(StandIn):
    def do_POST(self):  # noqa: N802 (http.server's name)
        self.server.received.append({"path": self.path, "host": self.headers["Host"], "body": self.body()})
        if self.server.redirect_to:
            return self.redirect(302, self.server.redirect_to)
        self.answer(200, {"ok": True})


@pytest.fixture
def make_server():
    with ExitStack() as stack:
        yield lambda redirect_to=None: stack.enter_context(serving(_Server, received=[], redirect_to=redirect_to))


@pytest.fixture
def nothing_listed(settings):
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = []
    settings.FLYWHEEL_OUTBOUND_PUBLIC = True


def _port(server) -> int:
    return server.server_address[1]


@pytest.mark.parametrize("url, why", [
    ("http://127.0.0.1:{port}/hook", "127.0.0.1 is a loopback address"),
    ("http://localhost:{port}/hook", "localhost resolves to 127.0.0.1, a loopback address"),
    ("http://[::ffff:127.0.0.1]:{port}/hook", "a loopback address"),
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is a link-local address"),
    ("http://10.1.2.3:8000/v1/load_lora_adapter", "10.1.2.3 is a private address"),
    ("http://0.0.0.0:{port}/", "0.0.0.0 is an unspecified address"),
])
def test_private_loopback_and_link_local_destinations_are_refused_before_any_byte(nothing_listed, make_server, url,
                                                                                  why):
    server = make_server()
    with pytest.raises(outbound.OutboundRefused, match=why + ", which FLYWHEEL_OUTBOUND_ALLOWLIST does not list"):
        outbound.post(url.format(port=_port(server)), body=b"{}")
    assert server.received == []  # refused before connecting, not a failed connection


def test_a_listed_host_is_reached(settings, make_server):
    server = make_server()
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = ["127.0.0.1"]
    response = outbound.post(f"http://127.0.0.1:{_port(server)}/hook?x=1", body=b'{"a": 1}',
                             headers={"Content-Type": "application/json"})
    assert response.status == 200 and response.ok and response.body == b'{"ok": true}'
    assert server.received == [{"path": "/hook?x=1", "host": f"127.0.0.1:{_port(server)}", "body": b'{"a": 1}'}]


def test_a_listed_network_and_a_listed_name(settings, make_server):
    server = make_server()
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = ["127.0.0.0/8"]
    assert outbound.post(f"http://localhost:{_port(server)}/", body=b"").status == 200
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = ["localhost"]
    assert outbound.post(f"http://localhost:{_port(server)}/", body=b"").status == 200
    with pytest.raises(outbound.OutboundRefused):  # the name is listed, not the address
        outbound.post(f"http://127.0.0.1:{_port(server)}/", body=b"")
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = ["10.0.0.0/8", "*.internal"]
    assert guard.check_url("http://10.9.8.7:8000/", outbound.policy()).addresses[0].exploded == "10.9.8.7"


def test_public_addresses_can_be_closed_too(settings):
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = []
    settings.FLYWHEEL_OUTBOUND_PUBLIC = False
    with pytest.raises(outbound.OutboundRefused, match="8.8.8.8 is a public address, and only the hosts"):
        guard.check_url("https://8.8.8.8/", outbound.policy())
    settings.FLYWHEEL_OUTBOUND_PUBLIC = True
    assert guard.check_url("https://8.8.8.8/", outbound.policy()).port == 443


def test_a_redirect_to_a_private_address_is_not_followed(settings, make_server):
    inner = make_server()
    outer = make_server(redirect_to=f"http://127.0.0.1:{_port(inner)}/secret")
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = ["127.0.0.1"]  # even a listed target: redirects are never followed
    with pytest.raises(outbound.OutboundRefused, match=r"answered HTTP 302 \(a redirect to http://127\.0\.0\.1:\d+"
                                                       r"/secret\); redirects are not followed"):
        outbound.post(f"http://127.0.0.1:{_port(outer)}/hook", body=b"{}")
    assert len(outer.received) == 1 and inner.received == []


def _resolver(answers: dict[str, list[str]], calls: list[str]):
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host in answers:
            calls.append(host)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in answers[host]]
        return real(host, port, *args, **kwargs)

    return getaddrinfo


def test_every_resolved_address_is_checked_and_the_connection_goes_to_the_checked_one(settings, make_server,
                                                                                     monkeypatch):
    server = make_server()
    calls: list[str] = []
    # A name with a public and a loopback address (what a rebinding DNS server answers): refused as a whole.
    monkeypatch.setattr(socket, "getaddrinfo", _resolver({"rebind.test": ["93.184.216.34", "127.0.0.1"],
                                                          "env.test": ["127.0.0.1"]}, calls))
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = []
    with pytest.raises(outbound.OutboundRefused, match="rebind.test resolves to 127.0.0.1, a loopback address"):
        outbound.post(f"http://rebind.test:{_port(server)}/", body=b"")
    # A listed name: resolved once, connected to that address, and the Host header still names it.
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = ["env.test"]
    calls.clear()
    assert outbound.post(f"http://env.test:{_port(server)}/reset", body=b"{}").status == 200
    assert calls == ["env.test"]
    assert server.received[-1]["host"] == f"env.test:{_port(server)}"


def test_https_connects_to_the_checked_address_and_verifies_the_name(settings, monkeypatch, tmp_path):
    """The connection is pinned to the address checked, but TLS still sends and verifies the host's name."""
    import ssl
    import threading
    from http.server import ThreadingHTTPServer

    import trustme

    ca = trustme.CA()  # the socket wrapped in TLS before it serves: not tests.standin.serving
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    server.received, server.redirect_to = [], None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("env.test").configure_cert(context)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
        monkeypatch.setattr(socket, "getaddrinfo", _resolver({"env.test": ["127.0.0.1"]}, []))
        settings.FLYWHEEL_OUTBOUND_ALLOWLIST = ["env.test", "127.0.0.1"]
        port = _port(server)
        assert outbound.post(f"https://env.test:{port}/reset", body=b"{}").status == 200
        assert server.received[-1]["host"] == f"env.test:{port}"
        with pytest.raises(ssl.SSLCertVerificationError):  # the certificate names env.test, not the address
            outbound.post(f"https://127.0.0.1:{port}/reset", body=b"{}")
    finally:
        server.shutdown()


def test_a_malformed_allowlist_entry_names_itself(settings):
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = ["10.0.0.0/8", "bad/entry"]
    with pytest.raises(ValueError, match="FLYWHEEL_OUTBOUND_ALLOWLIST: 'bad/entry' is neither a hostname"):
        outbound.policy()


def test_the_trainer_subprocess_gets_the_same_policy(settings, monkeypatch):
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = ["10.0.0.0/8", "vllm.internal"]
    settings.FLYWHEEL_OUTBOUND_PUBLIC = False
    for name, value in outbound.subprocess_env().items():
        monkeypatch.setenv(name, value)
    assert guard.env_policy() == outbound.policy()


# --- the call sites: webhooks and vLLM ------------------------------------------------------------------------


@pytest.fixture
def promoted(project, tmp_path):
    """Production moved to a version with an adapter: a move the webhook and a vLLM server are told of."""
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    v1 = services.base_model_register(project=project, name="tiny", path=str(tmp_path / "base"))
    v2 = services.model_version_create(project=project, base=v1.base, adapter_path=str(tmp_path / "adapter"))
    GateDecision.objects.create(project=project, candidate=v2, production=v1, passed=True)
    services.model_promote(project=project, version=v2)
    return v2


def test_a_vllm_server_or_webhook_on_a_refused_address_is_a_failed_delivery_naming_why(nothing_listed, project,
                                                                                      promoted, make_server):
    server = make_server()
    RegistrySettings.objects.create(project=project, webhook_url=f"http://127.0.0.1:{_port(server)}/hook",
                                    vllm_url="http://169.254.169.254/")
    services.registry_sync(project_id=project.pk)
    first = AliasEvent.objects.filter(project=project).order_by("at", "id").first()
    assert first.webhook_state == SyncState.FAILED
    assert [(d.target, d.status_code) for d in first.deliveries.all()] == [("webhook", None)]
    assert "127.0.0.1 is a loopback address" in first.deliveries.get().error
    RegistrySettings.objects.filter(project=project).update(webhook_url="")
    AliasEvent.objects.filter(project=project).update(next_attempt_at=None)
    services.registry_sync(project_id=project.pk)
    vllm = [d for e in AliasEvent.objects.filter(project=project) for d in e.deliveries.all() if d.target == "vllm"]
    assert vllm and "169.254.169.254 is a link-local address" in vllm[0].error
    assert server.received == []


def test_a_webhook_redirect_is_a_failed_delivery(settings, project, promoted, make_server):
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = ["127.0.0.1"]
    inner = make_server()
    outer = make_server(redirect_to=f"http://127.0.0.1:{_port(inner)}/")
    RegistrySettings.objects.create(project=project, webhook_url=f"http://127.0.0.1:{_port(outer)}/hook")
    services.registry_sync(project_id=project.pk)
    delivery = AliasEvent.objects.filter(project=project).order_by("at", "id").first().deliveries.get()
    assert "redirects are not followed" in delivery.error and inner.received == []


def test_a_webhook_to_a_listed_host_is_delivered(settings, project, promoted, make_server):
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = ["127.0.0.1"]
    server = make_server()
    RegistrySettings.objects.create(project=project, webhook_url=f"http://127.0.0.1:{_port(server)}/hook")
    services.registry_sync(project_id=project.pk)
    events = AliasEvent.objects.filter(project=project)
    assert [e.webhook_state for e in events] == [SyncState.DONE] * 2
    assert [e.deliveries.get().status_code for e in events] == [200, 200] and len(server.received) == 2


@pytest.mark.parametrize("field, url, why", [
    ("webhook_url", "http://169.254.169.254/latest", "169.254.169.254 is a link-local address"),
    ("vllm_url", "http://10.0.0.7:8000", "10.0.0.7 is a private address"),
    ("webhook_url", "http://localhost:9000/hook", "localhost resolves to 127.0.0.1, a loopback address"),
])
def test_saving_a_url_the_policy_refuses_is_a_field_error(nothing_listed, project, user, client_for, field, url,
                                                         why):
    response = client_for(user).post(reverse("registry_settings_save", args=[project.slug]), {field: url})
    html = response.content.decode()
    assert response.status_code == 422 and why in html
    assert not RegistrySettings.objects.filter(project=project).exclude(**{field: ""}).exists()


def test_saving_a_listed_url_works(settings, project, user, client_for):
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = ["10.0.0.0/8"]
    response = client_for(user).post(reverse("registry_settings_save", args=[project.slug]),
                                     {"vllm_url": "http://10.0.0.7:8000"})
    assert response.status_code == 302
    assert RegistrySettings.objects.get(project=project).vllm_url == "http://10.0.0.7:8000"
