"""Synthetic variants of a task, for when real examples are few.

Two kinds, both from the task's own row:
- argument values: for each argument an expected call states as a plain value that the request spells out,
  the values the project's trajectories passed to the same tool and argument, drawn only from those that
  may train: never from a trajectory behind an eval case, now or in a frozen eval-suite version (its values
  would carry the case into training). The request, the expected call and the reference all take the new
  value;
- rephrasings: the request put through a few fixed templates.
A variant is kept only if its verifier passes on its reference (through the trainer's environment, as at
promotion) and the leakage guard lets it in: every rule, the reworded-request one included, against the eval
side. It keeps its parent's origin, so it inherits the guard's rule about its trajectory.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction

from flywheel.accounts.services import project_lock
from flywheel.environments.models import Task, VariantKind
from flywheel.evals import leakage
from flywheel.evals import rows as row_shape
from flywheel.evals.promotion import score_output
from flywheel.evals.services import version_create
from flywheel.trajectories.models import Trajectory
from trainer.verifiers import parse_completion
from trainer.verifiers.matchers import is_matcher

REPHRASINGS = (
    "Hi! {request}",
    "Could you help me with this: {request}",
    "{request} Thanks in advance.",
    "I need this done, please. {request}",
)
MAX_VALUES_PER_ARGUMENT = 5
SCAN_TRAJECTORIES = 500  # the newest trajectories with tool calls whose argument values are drawn on


@dataclass
class VariantResult:
    saved: list[Task] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (what, why)
    version: Any = None


def _observed_values(project: Any, tool: str, argument: str, exclude: Any, eval_side: set[int]) -> list[Any]:
    """Distinct string values the project's trajectories, those on the eval side aside, passed to `tool`'s
    `argument`, newest first."""
    seen: list[Any] = []
    keys = {row_shape.canonical_json(exclude)}
    qs = Trajectory.objects.filter(project=project, tool_call_count__gt=0).order_by("-id").only("messages")
    # Skipped here rather than in the query: an eval side of thousands would be as many query parameters.
    drawable = (t for t in qs.iterator(chunk_size=100) if t.pk not in eval_side)
    for t in itertools.islice(drawable, SCAN_TRAJECTORIES):
        for m in t.messages if isinstance(t.messages, list) else []:
            if not (isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls")):
                continue
            for call in parse_completion(m).calls:
                value = call["arguments"].get(argument, None) if call["name"] == tool else None
                if isinstance(value, str) and value:
                    key = row_shape.canonical_json(value)
                    if key not in keys:
                        keys.add(key)
                        seen.append(value)
                        if len(seen) >= MAX_VALUES_PER_ARGUMENT:
                            return seen
    return seen


def _with_request(messages: list[Any], text: str) -> list[Any]:
    out = copy.deepcopy(messages)
    for m in reversed(out):
        if isinstance(m, dict) and m.get("role") == "user":
            m["content"] = text
            break
    return out


def _argument_drafts(task: Task, eval_side: set[int]) -> list[tuple[str, dict[str, Any]]]:
    verifier = task.verifier if isinstance(task.verifier, dict) else {}
    if verifier.get("type") != "tool_call" or not isinstance(task.reference, dict):
        return []
    request = row_shape.last_user_request(task.messages)
    drafts = []
    for k, expected in enumerate(verifier.get("expected_calls") or []):
        for argument, old in (expected.get("arguments") or {}).items():
            # Only a plain string the request spells out as a whole token (an id, a name, an email) can be
            # swapped in the request, the call and the reference; a number inside "50.00" cannot.
            if is_matcher(old) or not isinstance(old, str) or len(old) < 2:
                continue
            token = re.compile(rf"(?<![\w-]){re.escape(old)}(?![\w-])")
            if not token.search(request):
                continue
            for new in _observed_values(task.task_set.project, expected["name"], argument, old, eval_side):
                v = copy.deepcopy(verifier)
                v["expected_calls"][k]["arguments"][argument] = new
                reference = copy.deepcopy(task.reference)
                for call in reference.get("tool_calls") or []:
                    fn = call.get("function") or {}
                    args = json.loads(fn.get("arguments") or "{}")
                    if fn.get("name") == expected["name"] and args.get(argument) == old:
                        args[argument] = new
                        fn["arguments"] = json.dumps(args, ensure_ascii=False)
                draft = {"messages": _with_request(task.messages, token.sub(lambda _m, v=new: str(v), request)),
                         "verifier": v, "reference": reference, "kind": VariantKind.ARGUMENT,
                         "note": f"{expected['name']}.{argument}: {old!r} -> {new!r}"}
                drafts.append((draft["note"], draft))
    return drafts


def _rephrase_drafts(task: Task) -> list[tuple[str, dict[str, Any]]]:
    request = row_shape.last_user_request(task.messages).strip()
    if not request:
        return []
    return [(f"rephrased: {template.split('{')[0].strip() or template}",
             {"messages": _with_request(task.messages, template.format(request=request)), "verifier": task.verifier,
              "reference": task.reference, "kind": VariantKind.REPHRASE, "note": f"template {i + 1}"})
            for i, template in enumerate(REPHRASINGS)]


def task_variants_create(*, task: Task, user: Any = None, kinds: tuple[str, ...] = ("argument", "rephrase"),
                         limit: int = 20) -> VariantResult:
    """Make and keep the variants of `task` that pass their verifier on their reference and the leakage
    guard; one new version of the task set for all of them."""
    result = VariantResult()
    if task.reference is None:
        result.skipped.append((task.row_id, "the task has no reference output to check variants on"))
        return result
    project = task.task_set.project
    with transaction.atomic():
        # Under the project's lock the eval side cannot gain a row between the guard's read and the save.
        project_lock(project=project)
        eval_side = leakage.other_side(project=project, side="train")
        eval_trajectories = {c.trajectory_id for c in eval_side if c.trajectory_id is not None}
        drafts = ((_argument_drafts(task, eval_trajectories) if "argument" in kinds else [])
                  + (_rephrase_drafts(task) if "rephrase" in kinds else []))
        existing = {row_shape.prompt_digest(t.messages) for t in task.task_set.tasks.all()}
        for what, draft in drafts[:limit]:
            digest = row_shape.prompt_digest(draft["messages"])
            if digest in existing:
                result.skipped.append((what, "the task set already has this request"))
                continue
            row = row_shape.build_row(row_id="variant", messages=draft["messages"], tools=task.tools,
                                      verifier=draft["verifier"], env=task.env, trajectory_id=task.trajectory_id,
                                      failure_mode_id=task.failure_mode_id)
            try:
                passed = score_output(row, draft["reference"]).passed
            except ValueError as exc:
                result.skipped.append((what, str(exc)))
                continue
            if not passed:
                result.skipped.append((what, "its verifier fails its reference"))
                continue
            conflicts = leakage.leakage_conflicts(
                project=project, side="train", others=eval_side,
                candidates=[leakage.Candidate(what, task.trajectory_id, digest,
                                              row_shape.last_user_request(draft["messages"]))])
            if conflicts:
                result.skipped.append((what, "; ".join(map(str, conflicts))))
                continue
            existing.add(digest)
            result.saved.append(task.task_set.tasks.create(
                trajectory=task.trajectory, message_index=task.message_index, failure_mode=task.failure_mode,
                messages=draft["messages"], tools=task.tools, verifier=draft["verifier"], env=task.env,
                reference=draft["reference"], prompt_digest=digest,
                prompt_text=row_shape.last_user_request(draft["messages"])[:2000], created_by=user,
                parent=task, variant_kind=draft["kind"], variant_note=draft["note"][:300]))
        if result.saved:
            result.version = version_create(collection=task.task_set, user=user,
                                            note=f"added {len(result.saved)} variant(s) of {task.row_id}")
    return result
