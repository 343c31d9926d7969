"""Where the platform may send requests (flywheel.outbound): only to destinations the operator's settings
allow, checked on the resolved address at send time, never following a redirect.

Also: an IPv6 address that carries an IPv4 one is judged by the address inside; every request ends at one
overall deadline however slowly the server answers; a URL with credentials in it is refused at save and at send
time; URLs written into delivery logs and errors lose their credentials, query and fragment; delivery errors
show to maintainers only; the webhook's secret is bound to the webhook's origin.

Real sockets against stand-in servers on 127.0.0.1; the resolver is replaced only to make a name answer what
a hostile DNS server would (the boundary we do not own)."""

from __future__ import annotations

import re
import socket
import time
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


# --- IPv6 forms that carry an IPv4 address ------------------------------------------------------------------


@pytest.mark.parametrize("literal, inner", [
    ("::127.0.0.1", "127.0.0.1"),  # IPv4-compatible
    ("::ffff:0:7f00:1", "127.0.0.1"),  # SIIT's IPv4-translated
    ("64:ff9b::7f00:1", "127.0.0.1"),  # NAT64's well-known prefix
    ("64:ff9b::a00:7", "10.0.0.7"),
    ("2002:7f00:1::", "127.0.0.1"),  # 6to4
    ("2002:a9fe:a9fe::1", "169.254.169.254"),
    ("2001:0:4136:e378:8000:63bf:80ff:fffe", "127.0.0.1"),  # Teredo: a public server, the client on loopback
])
def test_an_ipv6_form_of_a_private_ipv4_address_is_refused_for_the_address_inside(nothing_listed, literal, inner):
    with pytest.raises(outbound.OutboundRefused, match=rf"refused: \S+ is an IPv6 form of {re.escape(inner)}, "
                                                       r"an? [a-z-]+ address, which FLYWHEEL_OUTBOUND_ALLOWLIST"):
        guard.check_url(f"http://[{literal}]:8000/hook", outbound.policy())


def test_ipv6_forms_of_public_or_listed_ipv4_addresses_pass_and_nat64_local_use_is_refused(settings, nothing_listed):
    for literal in ("64:ff9b::808:808", "2002:808:808::1", "::ffff:0:808:808"):  # 8.8.8.8 inside: public
        assert guard.check_url(f"http://[{literal}]/", outbound.policy()).port == 80
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = ["127.0.0.0/8"]  # the operator listed the IPv4 network
    assert guard.check_url("http://[::127.0.0.1]:9/", outbound.policy()).port == 9
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = []
    with pytest.raises(outbound.OutboundRefused, match="a NAT64 local-use address"):
        guard.check_url("http://[64:ff9b:1::7f00:1]/", outbound.policy())
    with pytest.raises(outbound.OutboundRefused, match="::1 is a loopback address"):  # IPv6's own, named as such
        guard.check_url("http://[::1]/", outbound.policy())


# --- one deadline for the whole request ---------------------------------------------------------------------

DRIP_S = 0.2  # between bytes: far within any per-read timeout
DRIP_BODY = 60  # bytes: 12 s of answer


class _Drip(StandIn):
    """Answers one byte every DRIP_S: the headers at once and the body dripped, or everything dripped. Counts
    what it sent and notes when the client went away."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.body()
        head = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {DRIP_BODY}\r\n\r\n"
                .encode())
        payload = b'"' + b"x" * (DRIP_BODY - 2) + b'"'
        fast, slow = (b"", head + payload) if self.server.drip == "headers" else (head, payload)
        try:
            self.wfile.write(fast)
            for i in range(len(slow)):
                self.wfile.write(slow[i:i + 1])
                self.server.sent += 1
                time.sleep(DRIP_S)
        except OSError:
            self.server.cut_off = True
        self.close_connection = True


@pytest.fixture
def drip():
    with ExitStack() as stack:
        yield lambda where: stack.enter_context(serving(_Drip, drip=where, sent=0, cut_off=False))


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_server_that_drips_its_answer_is_cut_off_at_the_requests_deadline(drip, where):
    server = drip(where)
    with pytest.raises(TimeoutError, match=r"/hook: no complete answer within 1 s"):
        outbound.post(server.url + "/hook?token=t0k", body=b"{}", timeout=1.0)
    # The server had most of its answer left when the client went; a per-read timeout alone read it all (12 s+).
    deadline = time.monotonic() + 5
    while not server.cut_off and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.cut_off and server.sent < DRIP_BODY // 2, (server.sent, server.cut_off)


def test_a_webhook_that_drips_is_a_failed_delivery_at_its_deadline(project, promoted, drip, monkeypatch):
    server = drip("body")
    monkeypatch.setattr(services, "WEBHOOK_TIMEOUT_S", 1)
    RegistrySettings.objects.create(project=project, webhook_url=server.url + "/hook")
    services.registry_sync(project_id=project.pk)
    delivery = AliasEvent.objects.filter(project=project).order_by("at", "id").first().deliveries.get()
    assert delivery.error.startswith("TimeoutError: ") and "no complete answer within 1 s" in delivery.error
    assert server.sent < DRIP_BODY // 2  # cut off with most of the answer unsent


# --- credentials in URLs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["webhook_url", "vllm_url"])
def test_a_serving_url_with_credentials_is_a_field_error_pointing_at_the_secret_fields(project, user, client_for,
                                                                                      field):
    response = client_for(user).post(reverse("registry_settings_save", args=[project.slug]),
                                     {field: "http://alice:hunter2@127.0.0.1:9/hook"})
    html = response.content.decode()
    assert response.status_code == 422 and "Remove the user name and password from the URL" in html
    assert "secret fields" in html
    assert not RegistrySettings.objects.filter(project=project).exclude(**{field: ""}).exists()


def test_the_judge_and_environment_server_urls_refuse_credentials_too(project, settings):
    from django.core.exceptions import ValidationError

    from flywheel.environments.services import environment_server_register
    from flywheel.evals import online

    with pytest.raises(ValidationError) as caught:
        online.online_settings_set(project=project, data={
            "enabled": False, "sample_rate": 0.1, "max_per_hour": 10, "threshold": 0.5,
            "judge_url": "https://alice:hunter2@judge.example.com/v1"})
    assert "Remove the user name and password" in caught.value.message_dict["judge_url"][0]
    settings.FLYWHEEL_ENV_URL_ALLOWLIST = ["http://127.0.0.1:9/"]
    with pytest.raises(ValidationError) as caught:
        environment_server_register(project=project, name="envs", url="http://alice:hunter2@127.0.0.1:9/team")
    assert "Remove the user name and password" in caught.value.message_dict["url"][0]


def test_a_stored_url_with_credentials_is_refused_at_send_time_and_never_written_out(project, promoted,
                                                                                    make_server):
    server = make_server()
    # As a server before this check stored it, past the model's clean.
    RegistrySettings.objects.create(project=project, webhook_url=f"http://alice:hunter2@127.0.0.1:{_port(server)}/hook")
    services.registry_sync(project_id=project.pk)
    event = AliasEvent.objects.filter(project=project).order_by("at", "id").first()
    delivery = event.deliveries.get()
    assert "may not carry a user name or password" in delivery.error and server.received == []
    assert "hunter2" not in delivery.url + delivery.error + event.last_error
    assert "alice" not in delivery.url + delivery.error + event.last_error


class _Redirect(StandIn):
    def do_POST(self):  # noqa: N802 (http.server's name)
        self.body()
        self.redirect(302, "http://127.0.0.1:9/elsewhere?sig=sig-s3cret")


def test_delivery_logs_and_errors_carry_no_query_or_credentials(project, promoted):
    with serving(_Redirect) as server:
        RegistrySettings.objects.create(project=project, webhook_url=server.url + "/hook?token=tok-s3cret#frag")
        services.registry_sync(project_id=project.pk)
    event = AliasEvent.objects.filter(project=project).order_by("at", "id").first()
    delivery = event.deliveries.get()
    assert delivery.url == server.url + "/hook"
    assert "redirects are not followed" in delivery.error and "http://127.0.0.1:9/elsewhere" in delivery.error
    written = delivery.url + delivery.error + event.last_error
    assert "s3cret" not in written and "frag" not in written


def test_delivery_errors_show_to_maintainers_only(project, promoted, user, make_user, make_membership, client_for):
    AliasEvent.objects.filter(project=project).update(webhook_state=SyncState.FAILED,
                                                      last_error="Webhook: webhook https://hooks.example/x: HTTP 500")
    viewer = make_user("viewer-1")
    make_membership(viewer, project, "viewer")
    seen = client_for(viewer).get(reverse("registry_page", args=[project.slug])).content.decode()
    assert "hooks.example" not in seen and "HTTP 500" not in seen
    assert "hooks.example" in client_for(user).get(reverse("registry_page", args=[project.slug])).content.decode()


def test_redact_takes_credentials_query_and_fragment_out_of_every_url_in_a_text():
    text = ("POST https://bob:pw@api.example.com:8443/v1/x?key=k1#top failed; then "
            "http://[::1]:9/y?sig=s, and ftp://u:p@files/z")
    assert outbound.redact(text) == ("POST https://api.example.com:8443/v1/x failed; then http://[::1]:9/y, and "
                                     "ftp://files/z")
    assert outbound.redact_url("http://[bad/") == "(a malformed URL)"


# --- the webhook secret is bound to the webhook's origin -------------------------------------------------------


def test_the_webhook_secret_must_be_given_again_when_the_webhook_moves_to_another_origin(project, user, client_for):
    client = client_for(user)
    save = reverse("registry_settings_save", args=[project.slug])
    assert client.post(save, {"webhook_url": "http://127.0.0.1:9001/hook", "webhook_secret": "whsec-a"}).status_code == 302
    # Another path on the same origin keeps the secret.
    assert client.post(save, {"webhook_url": "http://127.0.0.1:9001/hooks/v2"}).status_code == 302
    assert RegistrySettings.objects.get(project=project).webhook_secret == "whsec-a"
    moved = client.post(save, {"webhook_url": "http://127.0.0.1:9002/hook"})
    assert moved.status_code == 422 and "give it again for the new address" in moved.content.decode()
    config = RegistrySettings.objects.get(project=project)
    assert (config.webhook_url, config.webhook_secret) == ("http://127.0.0.1:9001/hooks/v2", "whsec-a")
    assert client.post(save, {"webhook_url": "http://127.0.0.1:9002/hook", "webhook_secret": "whsec-b"}).status_code == 302
    assert RegistrySettings.objects.get(project=project).webhook_secret == "whsec-b"
    assert client.post(save, {"webhook_url": "http://127.0.0.1:9003/hook", "webhook_secret_clear": "on"}).status_code == 302
    assert RegistrySettings.objects.get(project=project).webhook_secret == ""
