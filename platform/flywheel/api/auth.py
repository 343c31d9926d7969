"""Key authentication for the JSON API: a project API key with the scope an endpoint needs.

A key belongs to exactly one project, so the project is never in the URL: it comes from the key. A client
may name the project it means (`?project=SLUG`) as a safety check; naming another project than the key's
is refused with 403."""

from __future__ import annotations

from django.http import HttpRequest
from ninja.errors import AuthenticationError, HttpError
from ninja.security import HttpBearer

from flywheel.accounts import ratelimit
from flywheel.accounts.models import ApiKey, Scope
from flywheel.accounts.selectors import api_key_authenticate


class ApiKeyAuth(HttpBearer):
    """A project API key with the scope the endpoint needs."""

    openapi_description = (
        "A project API key: `Authorization: Bearer KEY`. The key decides the project; keys carry the scopes "
        "`ingest` (POST of trajectories), `read` (GET), `review` (failure modes, the review queue, promotion "
        "into suites and task sets), `train` (training jobs, eval runs, the training recipe, environment servers) "
        "and `promote` (moving production, the gate's rules, base models), and `route` (the reference router's "
        "alone: the key it vouches for its answers with). No or an unknown key: 401. A key without the "
        "scope, or a `?project=SLUG` that is not the key's project: 403. Over a key's rate "
        "(FLYWHEEL_API_RATE_PER_S, FLYWHEEL_API_BURST), or from an address that sent too many unknown keys "
        "(FLYWHEEL_API_AUTH_FAILURES_PER_MIN): 429 with Retry-After in seconds."
    )

    def __init__(self, scope: str) -> None:
        self.scope = Scope(scope).value
        super().__init__()

    def __call__(self, request: HttpRequest) -> ApiKey | None:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationError(401, "Send a project API key: Authorization: Bearer KEY")
        return self.authenticate(request, token.strip())

    def authenticate(self, request: HttpRequest, token: str) -> ApiKey | None:
        # An address that sent too many unknown keys is refused before its key is even looked up.
        address = ratelimit.client_address(request)
        ratelimit.api_address_check(address=address)
        api_key = api_key_authenticate(raw_key=token)
        if api_key is None:
            ratelimit.api_address_failed(address=address)
            raise AuthenticationError(401, "Unknown or revoked API key.")
        ratelimit.api_key_throttle(api_key_id=api_key.pk)
        if self.scope not in (api_key.scopes or []):
            raise HttpError(403, f"This API key lacks the '{self.scope}' scope.")
        named = request.GET.get("project")
        if named and named != api_key.project.slug:
            raise HttpError(403, f"This API key belongs to project '{api_key.project.slug}', not '{named}'.")
        return api_key


ingest_auth = ApiKeyAuth(Scope.INGEST)
read_auth = ApiKeyAuth(Scope.READ)
review_auth = ApiKeyAuth(Scope.REVIEW)
train_auth = ApiKeyAuth(Scope.TRAIN)
promote_auth = ApiKeyAuth(Scope.PROMOTE)
route_auth = ApiKeyAuth(Scope.ROUTE)
