"""Who gets what, for every route of the URLconf: one table of the expected answer to GET and to POST for
each kind of visitor. The routes come from walking the URLconf, so a new page or API operation that is not
in the table fails here until someone states who may use it.

Visitors: anonymous; a logged-in user of no project ("outsider"); staff of another project (is_staff, not
a superuser, maintainer elsewhere); a viewer, a reviewer and a maintainer of the project; and three API
keys (read-only and ingest-only of the project, both scopes of another project), sent without a session.
Every URL parameter names a real object of the project, so a view that forgot its check would answer 200
(or act) instead of 404 for want of the object. POSTs carry no CSRF token and no form data (the client does
not enforce CSRF): what is tested is the role check, and an answer past it (a redirect back, a 422 for the
empty form) shows that it let the visitor through."""

from __future__ import annotations

import re

import pytest
from django.apps import apps
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

VISITORS = (
    "anonymous", "outsider", "staff_other", "viewer", "reviewer", "maintainer", "key_read", "key_ingest", "key_other",
)  # fmt: skip  (the order requests go in: the maintainer's writes, e.g. removing a member, come after the others)

# What an answer must be: a status, or one of these.
LOGIN = "→ login"  # 302 to the login page, with ?next=
ADMIN_LOGIN = "→ admin login"  # 302 to the admin's login page
BACK = "→ back"  # 302 back to the trajectory page: a write went through (a plain form post)

# Project pages, per visitor (same order as VISITORS). A non-member gets 404 so that slugs do not leak; an
# API key opens no page.
_ = None  # filled per row below
READ = (LOGIN, 404, 404, 200, 200, 200, LOGIN, LOGIN, LOGIN)  # any member reads
NOT_ALLOWED = (405,) * 9  # the method is refused before anything else


def write(ok, role="reviewer"):
    """A write that needs `role`: members below it get 403, members with it get `ok`."""
    below = {"reviewer": ("viewer",), "maintainer": ("viewer", "reviewer")}[role]
    answers = {"anonymous": LOGIN, "outsider": 404, "staff_other": 404, "key_read": LOGIN, "key_ingest": LOGIN,
               "key_other": LOGIN}  # fmt: skip
    return tuple(answers.get(v, 403 if v in below else ok) for v in VISITORS)


def api(no_key, key_read, key_ingest, key_other):
    """An API operation: every visitor without a key (a session does not count) gets `no_key`."""
    return (no_key,) * 6 + (key_read, key_ingest, key_other)


# route (as the URLconf spells it): (answer to GET, answer to POST), each per visitor.
TABLE: dict[str, tuple[tuple, tuple]] = {
    "healthz": ((200,) * 9, (200,) * 9),
    "": ((LOGIN, 200, 200, 200, 200, 200, LOGIN, LOGIN, LOGIN), NOT_ALLOWED),
    "accounts/login/": ((200, 302, 302, 302, 302, 302, 200, 200, 200), (200, 302, 302, 302, 302, 302, 200, 200, 200)),
    "accounts/logout/": (NOT_ALLOWED, (302,) * 9),
    # Project settings: every member sees who has access; maintainers change members and keys.
    "p/<slug:project_slug>/settings/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/settings/members/": (NOT_ALLOWED, write(422, "maintainer")),
    "p/<slug:project_slug>/settings/members/<int:user_id>/": (NOT_ALLOWED, write(422, "maintainer")),
    "p/<slug:project_slug>/settings/members/<int:user_id>/remove/": (NOT_ALLOWED, write(200, "maintainer")),
    "p/<slug:project_slug>/settings/keys/": (NOT_ALLOWED, write(422, "maintainer")),
    "p/<slug:project_slug>/settings/keys/<int:key_id>/revoke/": (NOT_ALLOWED, write(200, "maintainer")),
    # Review: members read, reviewers write.
    "p/<slug:project_slug>/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/t/<int:trajectory_id>/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/t/<int:trajectory_id>/outcome": (NOT_ALLOWED, write(BACK)),
    "p/<slug:project_slug>/t/<int:trajectory_id>/comments": (NOT_ALLOWED, write(BACK)),
    "p/<slug:project_slug>/t/<int:trajectory_id>/tags": (NOT_ALLOWED, write(BACK)),
    "p/<slug:project_slug>/t/<int:trajectory_id>/tags/<int:tag_id>/remove": (NOT_ALLOWED, write(BACK)),
    # Triage: members read the policy and a re-run's progress; maintainers edit the policy and start re-runs.
    "p/<slug:project_slug>/triage/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/triage/policy": (NOT_ALLOWED, write(422, "maintainer")),  # no policy in the form
    "p/<slug:project_slug>/triage/runs": (NOT_ALLOWED, write(302, "maintainer")),
    "p/<slug:project_slug>/triage/runs/<int:run_id>/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/triage/runs/<int:run_id>/retry": (NOT_ALLOWED, write(409, "maintainer")),  # it is done
    # Uploads put trajectories into the project: reviewers and up, for reading their status too.
    "p/<slug:project_slug>/upload/": (write(200), write(400)),  # POST without a file: 400 naming it
    "p/<slug:project_slug>/upload/<int:upload_id>/": (write(200), NOT_ALLOWED),
    "p/<slug:project_slug>/upload/<int:upload_id>/retry": (NOT_ALLOWED, write(302)),
    # Connect your agent: every member reads the snippets; a POST carries the key just made in Settings.
    "p/<slug:project_slug>/connect/": (READ, READ),
    # Models: members read; maintainers register, promote, roll back and set the serving stack.
    "p/<slug:project_slug>/models/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/models/base": (NOT_ALLOWED, write(422, "maintainer")),  # the empty form: 422
    "p/<slug:project_slug>/models/rollback": (NOT_ALLOWED, write(409, "maintainer")),  # nothing served yet
    "p/<slug:project_slug>/models/settings": (NOT_ALLOWED, write(302, "maintainer")),
    "p/<slug:project_slug>/models/gate-rules": (NOT_ALLOWED, write(302, "maintainer")),  # blank: the defaults
    "p/<slug:project_slug>/models/v<int:version_number>/promote": (NOT_ALLOWED, write(302, "maintainer")),
    "p/<slug:project_slug>/models/gate/<int:decision_id>/": (READ, NOT_ALLOWED),
    # Canary and watch: maintainers start a canary (v2 passed the gate), decide it (none serves: 409) and set
    # the rules (blank keeps each); members read a live check's page.
    "p/<slug:project_slug>/models/v<int:version_number>/canary": (NOT_ALLOWED, write(302, "maintainer")),
    "p/<slug:project_slug>/models/canary/promote": (NOT_ALLOWED, write(409, "maintainer")),
    "p/<slug:project_slug>/models/canary/rollback": (NOT_ALLOWED, write(409, "maintainer")),
    "p/<slug:project_slug>/models/live-rules": (NOT_ALLOWED, write(302, "maintainer")),
    "p/<slug:project_slug>/models/checks/<int:check_id>/": (READ, NOT_ALLOWED),
    # A failure mode's rate per version (the fragment its page loads): members read.
    "p/<slug:project_slug>/models/failure-modes/<int:mode_id>/versions": (READ, NOT_ALLOWED),
    # Live metrics: members read a version's page; maintainers map strings to versions (the empty form: 422).
    "p/<slug:project_slug>/models/v<int:version_number>/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/models/names": (NOT_ALLOWED, write(422, "maintainer")),
    "p/<slug:project_slug>/models/names/remove": (NOT_ALLOWED, write(302, "maintainer")),
    # A version's price (the empty form clears it: back to its page).
    "p/<slug:project_slug>/models/v<int:version_number>/price": (NOT_ALLOWED, write(302, "maintainer")),
    "p/<slug:project_slug>/dashboard/": (READ, NOT_ALLOWED),
    # Training: members read jobs; maintainers start, confirm, cancel and retry them.
    # Eval runs: members read; maintainers start them (GPU work, as training jobs).
    "p/<slug:project_slug>/evals/runs/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/evals/runs/new": (NOT_ALLOWED, write(422, "maintainer")),  # the empty form: 422
    "p/<slug:project_slug>/evals/runs/compare": ((LOGIN, 404, 404, 400, 400, 400, LOGIN, LOGIN, LOGIN), NOT_ALLOWED),  # no runs named
    "p/<slug:project_slug>/evals/runs/<int:eval_run_id>/": (READ, NOT_ALLOWED),
    # Maintainers stop and retry runs. The table's run is queued: the maintainer's cancel goes through (302);
    # a queued run is not retried (409).
    "p/<slug:project_slug>/evals/runs/<int:eval_run_id>/cancel": (NOT_ALLOWED, write(302, "maintainer")),
    "p/<slug:project_slug>/evals/runs/<int:eval_run_id>/retry": (NOT_ALLOWED, write(409, "maintainer")),
    "p/<slug:project_slug>/training/": (READ, NOT_ALLOWED),
    # GET goes to the form on the jobs page (a reload of a refused form); the empty form's POST: 422.
    "p/<slug:project_slug>/training/new": ((LOGIN, 404, 404, 302, 302, 302, LOGIN, LOGIN, LOGIN), write(422, "maintainer")),
    "p/<slug:project_slug>/training/defaults/clear": (NOT_ALLOWED, write(302, "maintainer")),
    "p/<slug:project_slug>/training/<int:job_id>/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/training/<int:job_id>/curves": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/training/compare": ((LOGIN, 404, 404, 400, 400, 400, LOGIN, LOGIN, LOGIN), NOT_ALLOWED),  # no jobs named
    "p/<slug:project_slug>/training/<int:job_id>/checkpoints/<int:step>/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/training/<int:job_id>/confirm": (NOT_ALLOWED, write(409, "maintainer")),  # not ready
    "p/<slug:project_slug>/training/<int:job_id>/cancel": (NOT_ALLOWED, write(409, "maintainer")),  # finished
    "p/<slug:project_slug>/training/<int:job_id>/retry": (NOT_ALLOWED, write(409, "maintainer")),  # succeeded
    "api/v1/models/production": (api(401, 200, 403, 404), NOT_ALLOWED),  # no model in "other"
    "api/v1/models/production/rollback": (NOT_ALLOWED, api(401, 403, 403, 403)),  # needs `promote`
    "api/v1/models/history": (api(401, 200, 403, 200), NOT_ALLOWED),
    "api/v1/serving": (api(401, 200, 403, 200), NOT_ALLOWED),  # "other" has no model: production null, 200
    "api/v1/serving/evidence-key": (api(401, 403, 403, 403), NOT_ALLOWED),  # needs `route`, the router's alone
    "api/v1/model-versions/<number>": (api(401, 200, 403, 404), NOT_ALLOWED),
    "api/v1/model-versions/<number>/promote": (NOT_ALLOWED, api(401, 403, 403, 403)),  # needs `promote`
    "api/v1/training-jobs": (api(401, 200, 403, 200), api(401, 403, 403, 403)),  # starting needs `train`
    # Past the key, a comparison that names no jobs is 422 (which jobs is a parameter).
    "api/v1/training-jobs/compare": (api(401, 422, 403, 422), NOT_ALLOWED),
    "api/v1/training-jobs/<job_id>": (api(401, 200, 403, 404), NOT_ALLOWED),
    "api/v1/training-jobs/<job_id>/curves": (api(401, 200, 403, 404), NOT_ALLOWED),
    # Settings a script reads with `read` and replaces with PUT (PUT_TABLE below): the recipe needs `train`,
    # the gate's rules `promote`; registering a base model moves production when it is the first: `promote`.
    "api/v1/training-recipe": (api(401, 200, 403, 200), NOT_ALLOWED),
    "api/v1/gate-settings": (api(401, 200, 403, 200), NOT_ALLOWED),
    "api/v1/model-versions/<number>/canary": (NOT_ALLOWED, api(401, 403, 403, 403)),  # needs `promote`
    "api/v1/canary/promote": (NOT_ALLOWED, api(401, 403, 403, 403)),  # needs `promote`
    "api/v1/canary/rollback": (NOT_ALLOWED, api(401, 403, 403, 403)),  # needs `promote`
    "api/v1/live-rules": (api(401, 200, 403, 200), NOT_ALLOWED),
    "api/v1/live-checks": (api(401, 200, 403, 200), NOT_ALLOWED),
    "api/v1/model-versions/<number>/live": (api(401, 200, 403, 404), NOT_ALLOWED),  # no v1 in "other"
    "api/v1/model-versions/<number>/price": (api(401, 200, 403, 404), NOT_ALLOWED),  # no v1 in "other"
    "api/v1/version-names": (api(401, 200, 403, 200), api(401, 403, 403, 403)),  # mapping needs `promote`
    "api/v1/base-models": (NOT_ALLOWED, api(401, 403, 403, 403)),
    "api/v1/version": ((200,) * 9, NOT_ALLOWED),  # no key: a client checks it before anything else
    "api/v1/training-jobs/<job_id>/cancel": (NOT_ALLOWED, api(401, 403, 403, 403)),  # needs `train`
    "api/v1/eval-runs": (api(401, 200, 403, 200), api(401, 403, 403, 403)),  # starting needs `train`
    "api/v1/eval-runs/compare": (api(401, 422, 403, 422), NOT_ALLOWED),  # no runs named: 422
    "api/v1/eval-runs/<eval_run_id>": (api(401, 200, 403, 404), NOT_ALLOWED),
    "api/v1/eval-runs/<eval_run_id>/cancel": (NOT_ALLOWED, api(401, 403, 403, 403)),  # needs `train`
    "api/v1/eval-runs/<eval_run_id>/retry": (NOT_ALLOWED, api(401, 403, 403, 403)),  # needs `train`
    # Failure modes: members read; reviewers name modes, assign them (one trajectory or a selection of the
    # list) and work the queue; maintainers edit the taxonomy and delete modes. A form posted empty is
    # answered with its error: 422 on the page, or a redirect back with the error as a message.
    "p/<slug:project_slug>/failures/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/failures/new": (NOT_ALLOWED, write(422)),
    "p/<slug:project_slug>/failures/<int:mode_id>/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/failures/<int:mode_id>/edit": (NOT_ALLOWED, write(302)),
    "p/<slug:project_slug>/failures/<int:mode_id>/delete": (NOT_ALLOWED, write(302, "maintainer")),
    "p/<slug:project_slug>/failures/bulk-assign": (NOT_ALLOWED, write(302)),
    "p/<slug:project_slug>/taxonomy/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/taxonomy/categories": (NOT_ALLOWED, write(302, "maintainer")),
    "p/<slug:project_slug>/taxonomy/<int:category_id>/edit": (NOT_ALLOWED, write(302, "maintainer")),
    "p/<slug:project_slug>/taxonomy/<int:category_id>/delete": (NOT_ALLOWED, write(302, "maintainer")),
    "p/<slug:project_slug>/t/<int:trajectory_id>/modes": (NOT_ALLOWED, write(BACK)),
    "p/<slug:project_slug>/t/<int:trajectory_id>/modes/<int:mode_id>/remove": (NOT_ALLOWED, write(BACK)),
    # The review queue claims items for a reviewer: the page itself is for reviewers and up.
    "p/<slug:project_slug>/queue/": (write(200), NOT_ALLOWED),
    "p/<slug:project_slug>/queue/claim": (NOT_ALLOWED, write(302)),
    "p/<slug:project_slug>/queue/undo": (NOT_ALLOWED, write(302)),
    "p/<slug:project_slug>/queue/skips/clear": (NOT_ALLOWED, write(302)),
    "p/<slug:project_slug>/queue/<int:trajectory_id>/assign": (NOT_ALLOWED, write(302)),
    "p/<slug:project_slug>/queue/<int:trajectory_id>/modes/<int:mode_id>/remove": (NOT_ALLOWED, write(302)),
    "p/<slug:project_slug>/queue/<int:trajectory_id>/complete": (NOT_ALLOWED, write(302)),
    "p/<slug:project_slug>/queue/<int:trajectory_id>/skip": (NOT_ALLOWED, write(302)),
    # Clustering: members read suggestions and a run's progress; reviewers start runs and decide. The empty
    # start form is 422 (days must be stated); the run is done and the suggestion decided: 409 past the check.
    "p/<slug:project_slug>/clusters/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/clusters/runs": (NOT_ALLOWED, write(422)),
    "p/<slug:project_slug>/clusters/runs/<int:clustering_id>/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/clusters/runs/<int:clustering_id>/retry": (NOT_ALLOWED, write(409)),
    "p/<slug:project_slug>/clusters/s/<int:suggestion_id>/accept": (NOT_ALLOWED, write(409)),
    "p/<slug:project_slug>/clusters/s/<int:suggestion_id>/merge": (NOT_ALLOWED, write(422)),  # no mode chosen
    "p/<slug:project_slug>/clusters/s/<int:suggestion_id>/split": (NOT_ALLOWED, write(409)),
    "p/<slug:project_slug>/clusters/s/<int:suggestion_id>/dismiss": (NOT_ALLOWED, write(409)),
    # The API: a key decides the project and the scope; no session opens it.
    "api/v1/": ((404,) * 9, (404,) * 9),
    # The schema and its docs page are public, and django-ninja serves them to any method.
    "api/v1/openapi.json": ((200,) * 9, (200,) * 9),
    "api/v1/docs": ((200,) * 9, (200,) * 9),
    "api/v1/trajectories": (api(401, 200, 403, 200), api(401, 403, 200, 200)),
    "api/v1/trajectories/<trajectory_id>": (api(401, 200, 403, 404), NOT_ALLOWED),
    "api/v1/otlp/v1/traces": (NOT_ALLOWED, api(401, 403, 200, 200)),
    # Failure modes: reading needs `read`, every write `review` (none of these keys has it).
    "api/v1/failure-modes": (api(401, 200, 403, 200), api(401, 403, 403, 403)),
    "api/v1/failure-modes/<mode_id>/assign": (NOT_ALLOWED, api(401, 403, 403, 403)),
    "api/v1/failure-modes/<mode_id>/unassign": (NOT_ALLOWED, api(401, 403, 403, 403)),
    "api/v1/queue/claim": (NOT_ALLOWED, api(401, 403, 403, 403)),
    "api/v1/queue/<trajectory_id>/complete": (NOT_ALLOWED, api(401, 403, 403, 403)),
    "api/v1/clusterings": (NOT_ALLOWED, api(401, 403, 403, 403)),  # starting a run needs `review`
    "api/v1/clusterings/<clustering_id>": (api(401, 200, 403, 404), NOT_ALLOWED),
    "api/v1/clusterings/suggestions/<suggestion_id>/decision": (NOT_ALLOWED, api(401, 403, 403, 403)),
    # Eval suites and task sets: members read them, their versions and exports, and calibrate verifiers;
    # reviewers create them, promote into them (the form itself too), remove rows and make variants;
    # maintainers freeze versions. Empty forms are answered with their errors (422).
    "p/<slug:project_slug>/evals/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/evals/new": (NOT_ALLOWED, write(422)),
    "p/<slug:project_slug>/evals/<int:suite_id>/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/evals/<int:suite_id>/cases/<int:case_id>/remove": (NOT_ALLOWED, write(302)),
    "p/<slug:project_slug>/evals/<int:suite_id>/from-production": (NOT_ALLOWED, write(302, "maintainer")),
    "p/<slug:project_slug>/evals/<int:suite_id>/v/<int:number>/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/evals/<int:suite_id>/v/<int:number>.jsonl": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/evals/<int:suite_id>/v/<int:number>/freeze": (NOT_ALLOWED, write(302, "maintainer")),
    "p/<slug:project_slug>/evals/calibration/": (READ, NOT_ALLOWED),
    # Any member starts a calibration (it writes nothing but its own row; the empty form: 422) and reads one.
    "p/<slug:project_slug>/evals/calibration/runs": (NOT_ALLOWED, (LOGIN, 404, 404, 422, 422, 422, LOGIN, LOGIN, LOGIN)),
    "p/<slug:project_slug>/evals/calibration/runs/<int:calibration_id>/": (READ, NOT_ALLOWED),
    # Online evaluation: every member sees its settings and scores; maintainers change the settings.
    "p/<slug:project_slug>/online-eval/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/online-eval/settings": (NOT_ALLOWED, write(422, "maintainer")),
    "p/<slug:project_slug>/t/<int:trajectory_id>/promote": (write(200), write(422)),
    "p/<slug:project_slug>/promote/": (write(200), write(422)),
    "p/<slug:project_slug>/tasks/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/tasks/new": (NOT_ALLOWED, write(422)),
    "p/<slug:project_slug>/tasks/<int:task_set_id>/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/tasks/<int:task_set_id>/tasks/<int:task_id>/remove": (NOT_ALLOWED, write(302)),
    "p/<slug:project_slug>/tasks/<int:task_set_id>/tasks/<int:task_id>/variants": (NOT_ALLOWED, write(302)),
    "p/<slug:project_slug>/tasks/<int:task_set_id>/v/<int:number>/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/tasks/<int:task_set_id>/v/<int:number>.jsonl": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/tasks/<int:task_set_id>/v/<int:number>/freeze": (NOT_ALLOWED, write(302, "maintainer")),
    # Environment servers: members read; maintainers register (the empty form: 422) and check again (the world's
    # server is at a URL no allowlist lists: 422); reviewers make a task set on one (no name: 422).
    "p/<slug:project_slug>/environments/": (READ, NOT_ALLOWED),
    "p/<slug:project_slug>/environments/register": (NOT_ALLOWED, write(422, "maintainer")),
    "p/<slug:project_slug>/environments/<int:server_id>/check": (NOT_ALLOWED, write(422, "maintainer")),
    "p/<slug:project_slug>/environments/<int:server_id>/task-sets": (NOT_ALLOWED, write(422)),
    # Their API: reading needs `read`; creating and promoting need `review` (none of these keys has it).
    "api/v1/eval-suites": (api(401, 200, 403, 200), api(401, 403, 403, 403)),
    "api/v1/eval-suites/<suite_id>": (api(401, 200, 403, 404), NOT_ALLOWED),
    "api/v1/eval-suites/<suite_id>/versions": (api(401, 200, 403, 404), NOT_ALLOWED),
    "api/v1/eval-suites/<suite_id>/versions/<number>.jsonl": (api(401, 200, 403, 404), NOT_ALLOWED),
    "api/v1/eval-suites/<suite_id>/versions/<number>/power": (api(401, 200, 403, 404), NOT_ALLOWED),
    "api/v1/eval-suites/<suite_id>/regression-builds": (NOT_ALLOWED, api(401, 403, 403, 403)),  # needs `train`
    "api/v1/eval-suites/<suite_id>/promotions": (NOT_ALLOWED, api(401, 403, 403, 403)),
    "api/v1/eval-suites/<suite_id>/promotions/bulk": (NOT_ALLOWED, api(401, 403, 403, 403)),
    "api/v1/task-sets": (api(401, 200, 403, 200), api(401, 403, 403, 403)),
    "api/v1/task-sets/<task_set_id>": (api(401, 200, 403, 404), NOT_ALLOWED),
    "api/v1/task-sets/<task_set_id>/versions": (api(401, 200, 403, 404), NOT_ALLOWED),
    "api/v1/task-sets/<task_set_id>/versions/<number>.jsonl": (api(401, 200, 403, 404), NOT_ALLOWED),
    "api/v1/task-sets/<task_set_id>/promotions": (NOT_ALLOWED, api(401, 403, 403, 403)),
    "api/v1/task-sets/<task_set_id>/promotions/bulk": (NOT_ALLOWED, api(401, 403, 403, 403)),
    "api/v1/task-sets/<task_set_id>/tasks/<task_id>/variants": (NOT_ALLOWED, api(401, 403, 403, 403)),
    "api/v1/environment-servers": (api(401, 200, 403, 200), api(401, 403, 403, 403)),  # registering: `train`
    # Calibration changes nothing but its own row: `read` starts one (another project's key, on its own project)
    # and reads it; a worker computes it (202).
    "api/v1/verifier-calibrations": (NOT_ALLOWED, api(401, 202, 403, 202)),
    "api/v1/verifier-calibrations/<calibration_id>": (api(401, 200, 403, 404), NOT_ALLOWED),
    "api/v1/online-eval": (api(401, 200, 403, 200), NOT_ALLOWED),
    "api/v1/online-eval/scores": (api(401, 200, 403, 200), NOT_ALLOWED),
    # The Django admin is for superusers only (none of these visitors): its login page shows to all...
    "admin/login/": ((200,) * 9, (200,) * 9),
    # ...and every other admin route sends them to it, staff included.
    "admin/*": ((ADMIN_LOGIN,) * 9, (ADMIN_LOGIN,) * 9),
}
# Logging out of the admin is for those logged in to it: anyone else is sent to the admin's index.
TABLE["admin/logout/"] = ((302,) * 9, (302,) * 9)

# Routes that also answer PUT (replacing a setting): what each visitor gets. None of the keys has the scope.
PUT_TABLE: dict[str, tuple] = {
    "api/v1/training-recipe": api(401, 403, 403, 403),  # needs `train`
    "api/v1/gate-settings": api(401, 403, 403, 403),  # needs `promote`
    "api/v1/live-rules": api(401, 403, 403, 403),  # needs `promote`
    "api/v1/online-eval": api(401, 403, 403, 403),  # needs `promote`
    "api/v1/model-versions/<number>/price": api(401, 403, 403, 403),  # needs `promote`
}

# Routes that also answer DELETE: what each visitor gets. None of the keys has the scope.
DELETE_TABLE: dict[str, tuple] = {
    "api/v1/version-names": api(401, 403, 403, 403),  # needs `promote`
}

POST_BODIES = {  # what an API POST carries: the smallest valid body, so that the answer past auth is 200
    "api/v1/verifier-calibrations": '{"verifier": {"type": "exact", "expected": "x"}}',
    "api/v1/trajectories": "[]",
    "api/v1/otlp/v1/traces": '{"resourceSpans": []}',
}


def _routes(patterns=None, prefix=""):
    for entry in get_resolver().url_patterns if patterns is None else patterns:
        route = prefix + str(entry.pattern)
        if isinstance(entry, URLResolver):
            yield from _routes(entry.url_patterns, route)
        elif isinstance(entry, URLPattern):
            yield route


ROUTES = sorted(set(_routes()))


def _row(route):
    if route in TABLE:
        return TABLE[route]
    if route.startswith("admin/"):
        return TABLE["admin/*"]
    return None


@pytest.fixture
def world(db, settings, make_project, make_api_key):
    """The project, its members and objects, the visitors' clients, and the value of every URL parameter."""
    from django.contrib.auth import get_user_model
    from django.contrib.contenttypes.models import ContentType

    from flywheel.accounts.services import membership_set
    from flywheel.failures import review
    from flywheel.failures.services import failure_mode_assign, failure_mode_create, taxonomy_category_create
    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.models import Trajectory, TriageRun, Upload

    # The per-key and per-address API limits (helper settings; 0 turns each off) are tested elsewhere.
    settings.FLYWHEEL_API_RATE_PER_S = 0
    settings.FLYWHEEL_API_AUTH_FAILURES_PER_MIN = 0
    User = get_user_model()
    # Users without passwords (no hashing per test); force_login logs them in.
    users = {name: User.objects.create(username=name) for name in ("outsider", "viewer", "reviewer", "maintainer")}
    users["staff_other"] = User.objects.create(username="staff_other", is_staff=True)
    project = make_project("acme", owner=users["maintainer"])
    make_project("other", owner=users["staff_other"])
    for role in ("viewer", "reviewer"):
        membership_set(project=project, user=users[role], role=role)
    record = {"external_id": "t-1", "messages": [{"role": "user", "content": "hi"}]}
    assert ingest_trajectories(project=project, records=[record]).accepted == 1
    trajectory = Trajectory.objects.get(project=project)
    tag = review.trajectory_tag_add(trajectory=trajectory, name="t")
    upload = Upload.objects.create(project=project, filename="a.jsonl", content=b"{}", status="failed")
    run = TriageRun.objects.create(project=project, version=1, status="done")
    clustering, suggestion = _clustering_rows(project, trajectory)
    mode = failure_mode_create(project=project, name="m", category_key="other", user=users["maintainer"])
    failure_mode_assign(failure_mode=mode, trajectories=[trajectory], user=users["maintainer"])
    unused_category = taxonomy_category_create(project=project, name="unused")
    suite, case, task_set, task = _eval_rows(project, trajectory)
    keys = {
        "key_read": make_api_key(project, scopes=["read"]),
        "key_ingest": make_api_key(project, scopes=["ingest"]),
        "key_other": make_api_key(project.__class__.objects.get(slug="other")),
    }
    clients = {}
    for visitor in VISITORS:
        client = Client(enforce_csrf_checks=False)
        if visitor in users:
            client.force_login(users[visitor])
        if visitor in keys:
            client.defaults["HTTP_AUTHORIZATION"] = f"Bearer {keys[visitor]}"
        clients[visitor] = client
    values = {
        "project_slug": project.slug,
        "trajectory_id": trajectory.pk,
        "tag_id": tag.pk,
        "upload_id": upload.pk,
        "run_id": run.pk,
        "clustering_id": clustering.pk,
        "suggestion_id": suggestion.pk,
        "mode_id": mode.pk,
        "category_id": unused_category.pk,
        **_model_rows(project),
        "suite_id": suite.pk,
        "case_id": case.pk,
        "task_set_id": task_set.pk,
        "task_id": task.pk,
        "server_id": _environment_server(project).pk,
        "calibration_id": _calibration(project).pk,
        "number": 1,  # v1 of the suite and of the task set
        "user_id": users["viewer"].pk,
        "key_id": make_api_key(project, name="to revoke").api_key.pk,
        "app_label": "trajectories",
        "url": "no-such-page/",
        "id": users["viewer"].pk,  # admin/auth/user/<id>/password/
        "content_type_id": ContentType.objects.get_for_model(Trajectory).pk,  # admin/r/<ct>/<object_id>/
        "object_id": trajectory.pk,
    }
    return {"clients": clients, "values": values, "trajectory": trajectory}


def _clustering_rows(project, trajectory):
    """A finished clustering run and a suggestion of it that was already dismissed."""
    from flywheel.failures.clustering.models import ClusteringRun, ClusterSuggestion

    run = ClusteringRun.objects.create(project=project, status="done", stage="done")
    suggestion = ClusterSuggestion.objects.create(
        run=run, project=project, size=1, label="l", trajectory_ids=[trajectory.pk], decision="dismissed"
    )
    return run, suggestion


def _eval_rows(project, trajectory):
    """An eval suite with a case and a task set with a task, each at v1 (rows written directly: the world's
    trajectory has no assistant turn to promote)."""
    from flywheel.environments.services import task_set_create
    from flywheel.evals.services import suite_create, version_create

    verifier = {"type": "exact", "expected": "hello"}
    suite = suite_create(project=project, name="s")
    case = suite.cases.create(trajectory=trajectory, messages=trajectory.messages, verifier=verifier)
    version_create(collection=suite)
    task_set = task_set_create(project=project, name="ts")
    task = task_set.tasks.create(messages=[{"role": "user", "content": "other"}], verifier=verifier)
    version_create(collection=task_set)
    return suite, case, task_set, task


def _calibration(project):
    """A finished verifier calibration (the row only)."""
    from flywheel.evals.calibration import Calibration
    from flywheel.evals.calibration_models import VerifierCalibration

    return VerifierCalibration.objects.create(project=project, verifier={"type": "exact", "expected": "x"},
                                              status="done", result=Calibration().to_dict())


def _environment_server(project):
    from flywheel.environments.models import EnvironmentServer

    return EnvironmentServer.objects.create(project=project, name="gym", url="http://gym.invalid:8000")


def _model_rows(project):
    """v1 in production, v2 (not) with a passing gate decision, and a finished training job (rows only)."""
    from flywheel.environments.models import TaskSet
    from flywheel.evals.run_models import EvalRun
    from flywheel.registry.models import AliasAssignment, BaseModel, GateDecision, LiveCheck, ModelVersion
    from flywheel.training.models import TrainingJob

    base = BaseModel.objects.create(project=project, name="tiny", path="/models/tiny")
    v1 = ModelVersion.objects.create(project=project, number=1, base=base)
    AliasAssignment.objects.create(project=project, alias="production", version=v1)
    v2 = ModelVersion.objects.create(project=project, number=2, base=base)
    decision = GateDecision.objects.create(project=project, candidate=v2, production=v1, passed=True)
    task_set = TaskSet.objects.create(project=project, name="t")
    version = task_set.versions.create(number=1, rows=[], size=0, content_hash="0" * 64)
    job = TrainingJob.objects.create(project=project, task_set_version=version, base_version=v1, status="succeeded")
    job.checkpoints.create(step=3, path="/jobs/x/checkpoint-3", best=True)
    eval_run = EvalRun.objects.create(project=project, model_version=v1, suite_version=_suite_version(project))
    check = LiveCheck.objects.create(project=project, kind="watch", subject=v1, baseline=v2, status="passed",
                                     started_at=job.created_at, ends_at=job.created_at)
    return {"version_number": v2.number, "decision_id": decision.pk, "job_id": job.pk, "step": 3,
            "check_id": check.pk,
            "eval_run_id": eval_run.pk}


def _suite_version(project):
    from flywheel.evals.models import EvalSuite

    suite = EvalSuite.objects.create(project=project, name="runs", kind="holdout")
    return suite.versions.create(number=1, rows=[], size=0, content_hash="0" * 64)


def _url(route, values):
    """The route with each parameter replaced by its value. An admin object id is a real row of the model."""
    match = re.match(r"admin/(\w+)/(\w+)/<path:object_id>/", route)
    if match:
        model = apps.get_model(*match.groups())
        values = {**values, "object_id": model.objects.order_by("pk").values_list("pk", flat=True).first() or 1}
    path = re.sub(r"<(?:\w+:)?(\w+)>", lambda m: str(values[m.group(1)]), route)
    path = re.sub(r"\(\?P<(\w+)>[^)]*\)", lambda m: str(values[m.group(1)]), path)  # regex routes
    return "/" + path.replace("^", "").replace("$", "")


def _describe(response) -> str:
    location = response.get("Location")
    return f"{response.status_code}" + (f" → {location}" if location else "")


def _matches(response, expected, trajectory_url) -> bool:
    location = response.get("Location", "")
    if expected == LOGIN:
        return response.status_code == 302 and location.startswith("/accounts/login/?next=")
    if expected == ADMIN_LOGIN:
        return response.status_code == 302 and location.startswith("/admin/login/?next=")
    if expected == BACK:
        return response.status_code == 302 and location.split("#")[0] == trajectory_url
    return response.status_code == expected


def test_the_table_names_only_routes_that_exist():
    stale = [route for route in TABLE if route != "admin/*" and route not in ROUTES]
    assert not stale, f"routes in the table but not in the URLconf: {stale}"
    assert len(ROUTES) > 40  # the walk found the admin, the API and the pages


@pytest.mark.parametrize("route", sorted(PUT_TABLE))
def test_every_visitor_gets_what_the_put_table_says(world, route):
    assert route in ROUTES
    url = _url(route, world["values"])
    wrong = []
    for visitor, expected in zip(VISITORS, PUT_TABLE[route], strict=True):
        response = world["clients"][visitor].put(url, "{}", content_type="application/json")
        if response.status_code != expected:
            wrong.append(f"PUT {url} as {visitor}: expected {expected}, got {_describe(response)}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("route", sorted(DELETE_TABLE))
def test_every_visitor_gets_what_the_delete_table_says(world, route):
    assert route in ROUTES
    url = _url(route, world["values"]) + "?name=x"
    wrong = []
    for visitor, expected in zip(VISITORS, DELETE_TABLE[route], strict=True):
        response = world["clients"][visitor].delete(url)
        if response.status_code != expected:
            wrong.append(f"DELETE {url} as {visitor}: expected {expected}, got {_describe(response)}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("route", ROUTES)
def test_every_visitor_gets_what_the_table_says(world, route):
    row = _row(route)
    assert row is not None, f"/{route} is not in the authorization table: add what each visitor gets"
    url = _url(route, world["values"])
    trajectory_url = f"/p/acme/t/{world['trajectory'].pk}/"
    body = POST_BODIES.get(route)
    wrong = []
    for method, expected_row in zip(("GET", "POST"), row, strict=True):
        for visitor, expected in zip(VISITORS, expected_row, strict=True):
            client = world["clients"][visitor]
            if method == "GET":
                response = client.get(url)
            elif body is not None:
                response = client.post(url, body, content_type="application/json")
            else:
                response = client.post(url)
            if not _matches(response, expected, trajectory_url):
                wrong.append(f"{method} {url} as {visitor}: expected {expected}, got {_describe(response)}")
    assert not wrong, "\n".join(wrong)


# --- The page and the API ask the same of one action -------------------------------------------------------

# One action, two doors: (the page's route, method) and (the API's route, method). The page's role is read from
# TABLE above (tested against the pages' answers), the API's scope from the operation's own key check.
P = "p/<slug:project_slug>/"
ACTIONS: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {
    # Reading
    "list trajectories": ((P, "GET"), ("api/v1/trajectories", "GET")),
    "read a trajectory": ((P + "t/<int:trajectory_id>/", "GET"), ("api/v1/trajectories/<trajectory_id>", "GET")),
    "list failure modes": ((P + "failures/", "GET"), ("api/v1/failure-modes", "GET")),
    "read a clustering run": ((P + "clusters/runs/<int:clustering_id>/", "GET"),
                              ("api/v1/clusterings/<clustering_id>", "GET")),
    "list eval suites": ((P + "evals/", "GET"), ("api/v1/eval-suites", "GET")),
    "read an eval suite": ((P + "evals/<int:suite_id>/", "GET"), ("api/v1/eval-suites/<suite_id>", "GET")),
    "export a suite version": ((P + "evals/<int:suite_id>/v/<int:number>.jsonl", "GET"),
                               ("api/v1/eval-suites/<suite_id>/versions/<number>.jsonl", "GET")),
    "list task sets": ((P + "tasks/", "GET"), ("api/v1/task-sets", "GET")),
    "read a task set": ((P + "tasks/<int:task_set_id>/", "GET"), ("api/v1/task-sets/<task_set_id>", "GET")),
    "export a task set version": ((P + "tasks/<int:task_set_id>/v/<int:number>.jsonl", "GET"),
                                  ("api/v1/task-sets/<task_set_id>/versions/<number>.jsonl", "GET")),
    "list environment servers": ((P + "environments/", "GET"), ("api/v1/environment-servers", "GET")),
    "calibrate a verifier": ((P + "evals/calibration/", "GET"), ("api/v1/verifier-calibrations", "POST")),
    "read online evaluation": ((P + "online-eval/", "GET"), ("api/v1/online-eval", "GET")),
    "list eval runs": ((P + "evals/runs/", "GET"), ("api/v1/eval-runs", "GET")),
    "read an eval run": ((P + "evals/runs/<int:eval_run_id>/", "GET"), ("api/v1/eval-runs/<eval_run_id>", "GET")),
    "list training jobs": ((P + "training/", "GET"), ("api/v1/training-jobs", "GET")),
    "read a training job": ((P + "training/<int:job_id>/", "GET"), ("api/v1/training-jobs/<job_id>", "GET")),
    "read a job's curves": ((P + "training/<int:job_id>/curves", "GET"), ("api/v1/training-jobs/<job_id>/curves", "GET")),
    "read the models": ((P + "models/", "GET"), ("api/v1/models/history", "GET")),
    "read a model version": ((P + "models/v<int:version_number>/", "GET"), ("api/v1/model-versions/<number>/live", "GET")),
    # Putting trajectories in
    "upload trajectories": ((P + "upload/", "POST"), ("api/v1/trajectories", "POST")),
    # Review
    "name a failure mode": ((P + "failures/new", "POST"), ("api/v1/failure-modes", "POST")),
    "assign a failure mode": ((P + "failures/bulk-assign", "POST"), ("api/v1/failure-modes/<mode_id>/assign", "POST")),
    "assign a mode to a trajectory": ((P + "t/<int:trajectory_id>/modes", "POST"),
                                      ("api/v1/failure-modes/<mode_id>/assign", "POST")),
    "unassign a failure mode": ((P + "t/<int:trajectory_id>/modes/<int:mode_id>/remove", "POST"),
                                ("api/v1/failure-modes/<mode_id>/unassign", "POST")),
    "claim a queue item": ((P + "queue/claim", "POST"), ("api/v1/queue/claim", "POST")),
    "complete a queue item": ((P + "queue/<int:trajectory_id>/complete", "POST"),
                              ("api/v1/queue/<trajectory_id>/complete", "POST")),
    "start a clustering run": ((P + "clusters/runs", "POST"), ("api/v1/clusterings", "POST")),
    **{f"{verb} a suggestion": ((P + f"clusters/s/<int:suggestion_id>/{verb}", "POST"),
                                ("api/v1/clusterings/suggestions/<suggestion_id>/decision", "POST"))
       for verb in ("accept", "merge", "split", "dismiss")},
    "create an eval suite": ((P + "evals/new", "POST"), ("api/v1/eval-suites", "POST")),
    "create a task set": ((P + "tasks/new", "POST"), ("api/v1/task-sets", "POST")),
    "create a task set on an environment server": ((P + "environments/<int:server_id>/task-sets", "POST"),
                                                   ("api/v1/task-sets", "POST")),
    "promote into a suite": ((P + "t/<int:trajectory_id>/promote", "POST"),
                             ("api/v1/eval-suites/<suite_id>/promotions", "POST")),
    "promote into a task set": ((P + "t/<int:trajectory_id>/promote", "POST"),
                                ("api/v1/task-sets/<task_set_id>/promotions", "POST")),
    "promote a selection into a suite": ((P + "promote/", "POST"),
                                         ("api/v1/eval-suites/<suite_id>/promotions/bulk", "POST")),
    "promote a selection into a task set": ((P + "promote/", "POST"),
                                            ("api/v1/task-sets/<task_set_id>/promotions/bulk", "POST")),
    "make variants of a task": ((P + "tasks/<int:task_set_id>/tasks/<int:task_id>/variants", "POST"),
                                ("api/v1/task-sets/<task_set_id>/tasks/<task_id>/variants", "POST")),
    # GPU work and what it runs on
    "register an environment server": ((P + "environments/register", "POST"), ("api/v1/environment-servers", "POST")),
    "start an eval run": ((P + "evals/runs/new", "POST"), ("api/v1/eval-runs", "POST")),
    "cancel an eval run": ((P + "evals/runs/<int:eval_run_id>/cancel", "POST"),
                           ("api/v1/eval-runs/<eval_run_id>/cancel", "POST")),
    "retry an eval run": ((P + "evals/runs/<int:eval_run_id>/retry", "POST"),
                          ("api/v1/eval-runs/<eval_run_id>/retry", "POST")),
    "build a regression suite from production": ((P + "evals/<int:suite_id>/from-production", "POST"),
                                                 ("api/v1/eval-suites/<suite_id>/regression-builds", "POST")),
    "start a training job": ((P + "training/new", "POST"), ("api/v1/training-jobs", "POST")),
    "cancel a training job": ((P + "training/<int:job_id>/cancel", "POST"), ("api/v1/training-jobs/<job_id>/cancel", "POST")),
    "change the training recipe": ((P + "training/defaults/clear", "POST"), ("api/v1/training-recipe", "PUT")),
    # Production
    "register a base model": ((P + "models/base", "POST"), ("api/v1/base-models", "POST")),
    "promote a version": ((P + "models/v<int:version_number>/promote", "POST"),
                          ("api/v1/model-versions/<number>/promote", "POST")),
    "roll production back": ((P + "models/rollback", "POST"), ("api/v1/models/production/rollback", "POST")),
    "change the gate's rules": ((P + "models/gate-rules", "POST"), ("api/v1/gate-settings", "PUT")),
    "start a canary": ((P + "models/v<int:version_number>/canary", "POST"),
                       ("api/v1/model-versions/<number>/canary", "POST")),
    "promote the canary": ((P + "models/canary/promote", "POST"), ("api/v1/canary/promote", "POST")),
    "roll the canary back": ((P + "models/canary/rollback", "POST"), ("api/v1/canary/rollback", "POST")),
    "change the live rules": ((P + "models/live-rules", "POST"), ("api/v1/live-rules", "PUT")),
    "map a version name": ((P + "models/names", "POST"), ("api/v1/version-names", "POST")),
    "unmap a version name": ((P + "models/names/remove", "POST"), ("api/v1/version-names", "DELETE")),
    "set a version's or its base's price": ((P + "models/v<int:version_number>/price", "POST"),
                                            ("api/v1/model-versions/<number>/price", "PUT")),
    "change online evaluation": ((P + "online-eval/settings", "POST"), ("api/v1/online-eval", "PUT")),
}
# API operations that change something and have no page: why.
API_ONLY = {
    ("api/v1/otlp/v1/traces", "POST"): "an agent's exporter sends traces; people upload JSONL (POST /trajectories)",
}
# What a scope stands for on the pages (README, "Security model").
SCOPE_ROLE = {"read": "viewer", "ingest": "reviewer", "review": "reviewer", "train": "maintainer",
              "promote": "maintainer"}
MEMBERS = ("viewer", "reviewer", "maintainer")


def _api_scopes() -> dict[tuple[str, str], str | None]:
    """(route as the URLconf spells it, method) -> the scope its key must carry, None for no key."""
    from flywheel.api_urls import api

    found = {}
    for _prefix, router in api._routers:
        for path, view in router.path_operations.items():
            route = "api/v1" + re.sub(r"\{(\w+)\}", r"<\1>", path)
            for operation in view.operations:
                scopes = {auth.scope for auth in operation.auth_callbacks or []}
                assert len(scopes) <= 1, f"{route}: more than one scope"
                for method in operation.methods:
                    found[(route, method)] = next(iter(scopes), None)
    return found


def _page_role(route: str, method: str) -> str | None:
    """The lowest role TABLE lets through `method` on `route` (None: no member)."""
    row = TABLE[route][{"GET": 0, "POST": 1}[method]]
    assert row != NOT_ALLOWED, f"{method} /{route} is not allowed at all"
    answers = dict(zip(VISITORS, row, strict=True))
    return next((role for role in MEMBERS if answers[role] not in (403, 404, LOGIN)), None)


def test_every_api_write_is_an_action_of_the_table_or_has_no_page():
    paired = {api_door for _page, api_door in ACTIONS.values()}
    writes = {door for door, scope in _api_scopes().items() if door[1] != "GET" and scope is not None}
    missing = sorted(writes - paired - set(API_ONLY))
    assert not missing, f"API operations that change something, neither paired with a page nor API-only: {missing}"


def test_each_action_asks_the_same_on_the_page_as_in_the_api():
    """Derive what each scope stands for from the actions both doors offer: every scope must stand for one
    role, and that role must be what SCOPE_ROLE (the README's table) says."""
    scopes = _api_scopes()
    derived: dict[str, dict[str, list[str]]] = {}
    for action, ((page, page_method), api_door) in ACTIONS.items():
        assert page in TABLE and api_door in scopes, f"{action}: a door that does not exist"
        derived.setdefault(scopes[api_door], {}).setdefault(_page_role(page, page_method), []).append(action)
    disagree = [f"`{scope}` stands for " + "; ".join(f"{role} ({', '.join(actions)})" for role, actions in roles.items())
                for scope, roles in derived.items() if len(roles) > 1]
    assert not disagree, "the pages and the API disagree:\n" + "\n".join(disagree)
    assert {scope: next(iter(roles)) for scope, roles in derived.items()} == SCOPE_ROLE
