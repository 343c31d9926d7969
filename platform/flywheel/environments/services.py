"""Writes on task sets and environment servers. Versions, freezing and removal are the same functions as for
eval suites (`flywheel.evals.services`); tasks come in by promotion (`flywheel.evals.promotion`) or as variants
(`flywheel.environments.variants`).

An environment server (the trainer's `http` environment) is registered only at a URL the operator lists in
FLYWHEEL_ENV_URL_ALLOWLIST, and only once it answered `POST /reset` through the outbound guard (which refuses
private and loopback addresses FLYWHEEL_OUTBOUND_ALLOWLIST does not list). Its task sets' tasks run there."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote, urlsplit

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import URLValidator
from django.db import IntegrityError, transaction
from django.utils import timezone

from flywheel import outbound
from flywheel.accounts.models import Project
from flywheel.environments.models import EnvironmentServer, TaskSet
from flywheel.evals.services import clean_name

# How long registration waits for the server's /reset.
PROBE_TIMEOUT_S = 10.0


def task_set_create(*, project: Project, name: str, description: str = "", user: Any = None,
                    server: EnvironmentServer | None = None) -> TaskSet:
    """A task set; with `server`, its tasks run on that environment server."""
    name = clean_name(name)
    if server is not None and server.project_id != project.pk:
        raise ValidationError({"server": "That environment server belongs to another project."})
    try:
        with transaction.atomic():
            return TaskSet.objects.create(project=project, name=name, description=description, created_by=user,
                                          server=server)
    except IntegrityError:
        raise ValidationError({"name": f"This project already has a task set named {name!r}."}) from None


# --- environment servers -------------------------------------------------------------------------------------


def _decoded(segment: str) -> str | None:
    """A path segment percent-decoded as far as it goes (%252e is %2e to one decoder and "." to the next); None
    when it does not settle in three rounds."""
    for _ in range(3):
        decoded = unquote(segment)
        if decoded == segment:
            return segment
        segment = decoded
    return None


def _segments(path: str) -> list[str] | None:
    """The path's segments as a server may read them: percent-decoded, `;params` dropped, empty ones collapsed.
    None when one is a dot segment or holds a slash or a backslash once decoded: a server or a proxy on the way
    may resolve `/team-a/../team-b` (or `%2e%2e`, `..;`, `..%2f`) to another team's path, so such a path is
    never compared, only refused."""
    segments = []
    for raw in path.split("/"):
        segment = _decoded(raw)
        if segment is None or "/" in segment or "\\" in segment:
            return None
        segment = segment.split(";", 1)[0]
        if segment in (".", ".."):
            return None
        if segment:
            segments.append(segment)
    return segments


def _plain(url: str) -> bool:
    """No query, no fragment, and a path of plain segments (`_segments`)."""
    return "?" not in url and "#" not in url and _segments(urlsplit(url).path) is not None


def _origin_and_path(url: str) -> tuple[str, str, int | None, list[str] | None]:
    parts = urlsplit(url)
    return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port, _segments(parts.path)


def env_url_allowed(url: str) -> bool:
    """Whether `url` is at or under one of FLYWHEEL_ENV_URL_ALLOWLIST's URL prefixes: the same scheme, host and
    port, and the entry's path segments first (`/team-a` covers `/team-a/x`, not `/team-ab`). A URL with a dot
    segment, a backslash, a query or a fragment is under none."""
    try:
        if not _plain(url):
            return False
        scheme, host, port, path = _origin_and_path(url)
    except ValueError:
        return False
    for entry in getattr(settings, "FLYWHEEL_ENV_URL_ALLOWLIST", []) or []:
        try:
            e_scheme, e_host, e_port, e_path = _origin_and_path(entry)
        except ValueError:
            continue
        if e_path is not None and (scheme, host, port) == (e_scheme, e_host, e_port) and path[:len(e_path)] == e_path:
            return True
    return False


def environment_server_check(url: str) -> None:
    """What registration asks of a URL: well formed, listed by the operator, reachable through the outbound
    guard, and answering `POST /reset` with a session. Raises ValidationError on the field `url`."""
    try:
        URLValidator(schemes=["http", "https"])(url)
    except ValidationError:
        raise ValidationError({"url": "Enter an http:// or https:// URL."}) from None
    outbound.check_no_credentials(url, "url")
    if not _plain(url):
        raise ValidationError({"url": "Give the server's URL without a query or a fragment, and with a path of "
                                      "plain segments (no . or .. segment, no encoded slash or backslash)."})
    if not env_url_allowed(url):
        raise ValidationError({"url": f"{url} is not in FLYWHEEL_ENV_URL_ALLOWLIST: the operator lists the "
                                      "environment servers that may be registered."})
    probe = {"task": {"id": "flywheel-probe", "messages": [{"role": "user", "content": "ping"}], "tools": [],
                      "env": {"type": "http", "url": url}}}
    target = outbound.redact_url(url.rstrip("/") + "/reset")
    try:
        response = outbound.post_json(url.rstrip("/") + "/reset", probe, timeout=PROBE_TIMEOUT_S)
    except outbound.OutboundError as exc:
        raise ValidationError({"url": f"Not checked: {exc}."}) from None
    except OSError as exc:  # refused, unreachable, timed out
        raise ValidationError({"url": outbound.redact(f"The server did not answer POST {target}: "
                                                      f"{type(exc).__name__}: {exc}.")}) from None
    except Exception as exc:  # noqa: BLE001 (a broken HTTP answer is the server's fault, told as such)
        raise ValidationError({"url": outbound.redact(f"The server's answer to POST {target} is broken: "
                                                      f"{exc}.")}) from None
    if not response.ok:
        raise ValidationError({"url": f"The server answered POST {target} with HTTP {response.status}."})
    try:
        answer = json.loads(response.body)
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or answer.get("session_id") in (None, "") or isinstance(answer.get("session_id"), bool):
        raise ValidationError({"url": f"The server's answer to POST {target} is not a JSON object with a "
                                      "\"session_id\": is it an environment server (trainer.envs.http_env)?"})


def environment_server_register(*, project: Project, name: str, url: str, description: str = "",
                                user: Any = None) -> EnvironmentServer:
    """Register a team's environment server once it answered `/reset` (ValidationError naming the field)."""
    name = clean_name(name)
    url = url.strip()
    if project.environment_servers.filter(url=url).exists():
        raise ValidationError({"url": "This environment server is registered already."})
    environment_server_check(url)
    try:
        with transaction.atomic():
            return EnvironmentServer.objects.create(project=project, name=name, url=url, description=description,
                                                    created_by=user, checked_at=timezone.now())
    except IntegrityError:
        raise ValidationError({"name": f"This project already has an environment server named {name!r}."}) from None


def environment_server_recheck(*, server: EnvironmentServer) -> EnvironmentServer:
    """Ask the server's /reset again (the allowlists may have changed since it was registered)."""
    environment_server_check(server.url)
    server.checked_at = timezone.now()
    server.save(update_fields=["checked_at"])
    return server

