"""A newcomer's walk of the README's demo in real Chromium, timed step by step: from a fresh `make run`, promote
one of the failures the workplace demo left out of its task set into the regression suite, then train with one
click and every default, read the gate's report, promote, roll back and start the passed version as a canary,
all through the pages, as a person clicks them.

    .venv/bin/python bench/newcomer_walk.py [--walks 3] [--out DIR] [--port N] [--canary-percent 20]
    .venv/bin/python bench/newcomer_walk.py --url http://localhost:8000/ --login var/local-login.json

By default each walk starts `make run` itself with a fresh `FLYWHEEL_VAR_DIR` in a scratch folder and a free
`FLYWHEEL_PORT`, reads the address and the login it prints, waits on the pages until the worker has seeded the
demo, walks, and stops it as Ctrl-C does (SIGINT to its process group). `--run-command` starts it otherwise
(`make -o .venv/.flywheel-installed run` skips setup's check of the installed packages). `--url` and `--login`
(the `var/local-login.json` of a running platform) walk one that is already running, once: a second walk there
would not start from scratch.

Steps (each timed, each with a full-page screenshot in `--out`, default a new temporary folder):
`make run` until it prints the address; log in; open the workplace project; the demo seeded (the pages say
what the worker is doing until then); find a failure the task set left out (the task set's page names the
trajectory behind each task; the trajectories list, filtered to failures, has the others); open it; Promote;
Run checks (into the regression suite, the expected call corrected); Save; Training's form with every default,
"Measure production, then advise"; "Start training" once production is measured; the job's end; the gate's
report; Promote; on the Models page "Roll back to this" the version before; "Start as canary" for the passed
version at `--canary-percent`; and the stop of `make run`.

A step that cannot be done is a finding: the walk stops there with the step, the address and a screenshot
(FAILED-<step>.png), and the command exits 1. One line a step, then a JSON line:
{"walks": [{"steps": [{"step", "seconds", "ok"}], "gate", "holdout_before", "holdout_after", "trips", ...}],
"passed": <walks that ended with the canary started>}. `trips` are what a newcomer would stumble on without
the walk failing: a page that did not update by itself or scrolls sideways, seconds in which the pages said
nothing of the seeding, a console error, a failed request, a dialog.

Needs Playwright's Python package (a dev dependency) and Debian's Chromium (`/usr/bin/chromium`, or
CHROMIUM_PATH), launched as tests/browser/conftest.py launches it; without Chromium it prints a "skipped" line.
The machine's time dominates: on two shared cores the demo's seeding took 31-95 s and the training job with
its gate 100-163 s (about 8 minutes when the cores are busy)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SLUG = "workplace"
PROJECT_NAME = "Workplace assistant (tiny model)"
TASK_SET_NAME = "Workplace requests the model got wrong"
REGRESSION_LABEL = "Workplace regressions (regression)"
# As tests/browser/conftest.py launches Chromium.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1280, "height": 900}
ACTIVE = {"evaluating", "queued", "running"}  # a training job's statuses while a worker has it (JobStatus.ACTIVE)


class WalkFailed(Exception):
    def __init__(self, step: str, url: str, error: str, screenshot: str) -> None:
        super().__init__(f"step {step!r} could not be done at {url}: {error} (screenshot {screenshot})")
        self.step, self.url, self.error, self.screenshot = step, url, error, screenshot


# --- the platform, as `make run` starts it ------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Platform:
    """`make run` in its own process group, so that stopping it is the terminal's Ctrl-C: SIGINT to the group."""

    def __init__(self, command: str, var_dir: Path, port: int, log: Path) -> None:
        self.command, self.var_dir, self.port, self.log = command, var_dir, port, log
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> tuple[str, dict[str, str]]:
        env = {**os.environ, "FLYWHEEL_VAR_DIR": str(self.var_dir), "FLYWHEEL_PORT": str(self.port)}
        for name in ("DATABASE_URL", "CELERY_BROKER_URL", "MLFLOW_TRACKING_URI", "MLFLOW_ARTIFACT_ROOT",
                     "FLYWHEEL_JOBS_DIR", "FLYWHEEL_MODELS_DIR"):
            env.pop(name, None)  # everything under the fresh var folder, as on a fresh clone
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(shlex.split(self.command), cwd=ROOT, env=env, stdout=out,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace"))
            running = re.search(r"Flywheel is running at (\S+)", text)
            if running:
                return running.group(1), self._login(text)
            if self.process.poll() is not None:
                raise RuntimeError(f"`{self.command}` exited with status {self.process.returncode} before printing "
                                   f"the address; its log ends:\n{text[-3000:]}")
            time.sleep(1)
        raise TimeoutError(f"`{self.command}` printed no address in {timeout_s:.0f} s; see {self.log}")

    def _login(self, text: str) -> dict[str, str]:
        printed = re.search(r"Admin login: username (\S+)\s+password (\S+)", text)
        if printed:
            return {"username": printed.group(1), "password": printed.group(2)}
        return json.loads((self.var_dir / "local-login.json").read_text())

    def stop(self, grace_s: float = 60) -> dict[str, Any]:
        """Ctrl-C: SIGINT to the whole group; SIGKILL what is left after `grace_s`. Returns the exit status and
        the seconds the stop took."""
        if self.process is None:
            return {}
        t0 = time.monotonic()
        pgid = self.process.pid
        try:
            os.killpg(pgid, signal.SIGINT)
        except ProcessLookupError:
            pass
        try:
            status = self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            status = None
        # `make` may exit before the web server and the workers it started have stopped: wait for the group.
        while time.monotonic() - t0 < grace_s:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        else:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if status is None:
                status = self.process.wait()
            return {"exit": status, "seconds": round(time.monotonic() - t0, 1), "killed": True}
        return {"exit": status, "seconds": round(time.monotonic() - t0, 1), "killed": False}


# --- what a newcomer would type ------------------------------------------------------------------------------


def correct_call(external_id: str) -> dict[str, Any]:
    """The call the demo request `workplace-req-<i>` asks for. A newcomer reads the request ("Reassign "Write
    login page" (T5) to Oscar.") and types the call it needs; the walk takes it from the request the demo
    generated, as the seeding makes its task rows (flywheel.training.demo: generate_tasks(300, seed=21,
    split="train", difficulty="single"), the first call of the task's solution)."""
    from trainer.envs.workplace import generate_tasks

    index = int(external_id.removeprefix("workplace-req-"))
    task = generate_tasks(300, seed=21, split="train", difficulty="single")[index]
    call = next(m for m in task["solution"] if m.get("tool_calls"))["tool_calls"][0]["function"]
    return {"request": task["messages"][-1]["content"],
            "call": {"name": call["name"], "arguments": json.loads(call["arguments"])}}


# --- the walk ------------------------------------------------------------------------------------------------


class Walk:
    """One walk in one browser context: its steps, timed and shot, and what tripped."""

    def __init__(self, number: int, page: Any, out: Path, base_url: str) -> None:
        self.number, self.page, self.out, self.base_url = number, page, out, base_url.rstrip("/")
        self.steps: list[dict[str, Any]] = []
        self.trips: list[str] = []
        self.figures: dict[str, Any] = {}
        self.dialogs: list[str] = []
        self.console_errors: list[str] = []
        self.failed_requests: list[str] = []
        page.on("dialog", self._dialog)
        page.on("console", lambda msg: self.console_errors.append(f"{page.url}: {msg.text}")
                if msg.type == "error" and not msg.text.startswith("Failed to load resource") else None)
        page.on("pageerror", lambda exc: self.console_errors.append(f"{page.url}: {exc}"))
        page.on("response", lambda r: self.failed_requests.append(f"{r.status} {r.request.method} {r.url}")
                if r.status >= 400 and not r.url.endswith("/favicon.ico") else None)

    def _dialog(self, dialog: Any) -> None:
        # A newcomer asked to confirm says yes; the question is kept.
        self.dialogs.append(f"{self.page.url}: {dialog.type}: {dialog.message}")
        dialog.accept()

    def shot(self, name: str) -> str:
        path = self.out / (re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") + ".png")
        try:
            self.page.screenshot(path=str(path), full_page=True)
        except Exception as exc:  # a screenshot must not hide the finding it illustrates
            return f"(no screenshot: {exc})"
        return str(path)

    @contextmanager
    def step(self, name: str) -> Iterator[dict[str, Any]]:
        record: dict[str, Any] = {"step": name, "ok": False}
        self.steps.append(record)
        t0 = time.monotonic()
        try:
            yield record
        except Exception as exc:
            record["seconds"] = round(time.monotonic() - t0, 1)
            record["url"] = self.page.url
            record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            record["screenshot"] = self.shot(f"FAILED-{len(self.steps):02d}-{name}")
            print(f"walk {self.number} FAILED {name} after {record['seconds']} s at {record['url']}: {exc}",
                  flush=True)
            raise WalkFailed(name, record["url"], record["error"], record["screenshot"]) from exc
        record["seconds"] = round(time.monotonic() - t0, 1)
        record["ok"] = True
        if self.page.url != "about:blank":  # `make run` is a step before any page
            record["screenshot"] = self.shot(f"{len(self.steps):02d}-{name}")
            self.check_width()
        detail = record.get("detail", "")
        print(f"walk {self.number} {len(self.steps):2d} {name:<28} {record['seconds']:8.1f} s  {detail}", flush=True)

    def check_width(self) -> None:
        """A page wider than the window scrolls sideways: noted with the widest element that sticks out."""
        wide = self.page.evaluate("""() => {
            const width = document.documentElement.clientWidth;
            if (document.documentElement.scrollWidth <= width) return null;
            let widest = null;
            for (const el of document.querySelectorAll("main *")) {
                const right = el.getBoundingClientRect().right;
                if (right > width + 1 && (!widest || right > widest.right + 0.5)) {
                    const classes = typeof el.className === "string" ? el.className.trim().split(/\\s+/) : [];
                    widest = {right, name: el.tagName.toLowerCase() + (el.id ? "#" + el.id : "")
                              + classes.filter(Boolean).map(c => "." + c).join("")};
                }
            }
            return {scroll: document.documentElement.scrollWidth, width, widest: widest && widest.name};
        }""")
        if wide:
            self.trips.append(f"{self.page.url}: the page is {wide['scroll']} px wide in a {wide['width']} px window "
                              f"and scrolls sideways ({wide['widest']} sticks out)")

    def nav(self, label: str) -> None:
        """A link of the project's navigation bar, as a person clicks it."""
        self.page.locator("nav.topnav").get_by_role("link", name=label, exact=True).click()
        self.page.wait_for_load_state()

    def wait_for(self, selector: str, *, timeout_s: float, job_url: str | None = None,
                 say: Callable[[], str] | None = None) -> str:
        """Wait for `selector` on the page as it updates itself (the job page polls every 2 s). With `job_url`,
        the job's state is also read beside the page: once the job has left the worker's hands, the page has a
        minute to show it before the walk reloads it and notes that it did not update by itself."""
        page = self.page
        deadline = time.monotonic() + timeout_s
        settled_at: float | None = None
        last_said = 0.0
        while True:
            if page.locator(selector).count():
                return page.locator(selector).first.inner_text()
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"{selector} did not appear in {timeout_s:.0f} s")
            if job_url:
                status = page.request.get(f"{job_url}curves").json().get("status")
                if status not in ACTIVE and settled_at is None:
                    settled_at = now
                if settled_at is not None and now - settled_at > 60:
                    self.trips.append(f"{page.url}: the job was {status} but the page did not show it within a minute "
                                      "by itself; reloaded")
                    page.reload()
                    settled_at = None
            if say and now - last_said > 60:
                print(f"walk {self.number}    ... {say()}", flush=True)
                last_said = now
            page.wait_for_timeout(3000)

    # --- the steps ------------------------------------------------------------------------------------------

    def log_in(self, login: dict[str, str]) -> None:
        page = self.page
        with self.step("log in") as s:
            page.goto(self.base_url + "/")
            page.fill("input[name=username]", login["username"])
            page.fill("input[name=password]", login["password"])
            page.get_by_role("button", name="Log in").click()
            page.get_by_role("link", name=PROJECT_NAME).wait_for()
            s["detail"] = page.url

    def open_project(self) -> None:
        with self.step("open the workplace project") as s:
            self.page.get_by_role("link", name=PROJECT_NAME).click()
            self.page.wait_for_load_state()
            s["detail"] = self.page.url

    def wait_seeded(self, timeout_s: float) -> None:
        """Reload the dashboard while it says what the worker is doing; seeded once it says nothing and the
        Tasks page lists the demo's task set."""
        page = self.page
        with self.step("demo seeded") as s:
            said: list[str] = []
            silent_s, silent_since = 0.0, None
            self.nav("Dashboard")
            deadline = time.monotonic() + timeout_s
            while True:
                status = page.locator("#demo-status")
                if status.count():
                    text = status.first.inner_text().split(" The demo's")[0]
                    if not said or said[-1] != text:
                        said.append(text)
                        print(f"walk {self.number}    ... the page says: {text}", flush=True)
                    if silent_since is not None:
                        silent_s += time.monotonic() - silent_since
                        silent_since = None
                else:
                    first_silence = silent_since is None and not said
                    if first_silence:
                        self.shot(f"{len(self.steps):02d}-seeding-not-said-yet-dashboard")
                    self.nav("Tasks")
                    if page.get_by_role("link", name=TASK_SET_NAME).count():
                        break
                    # Neither the seeding's step nor its result: what a newcomer sees says nothing is coming.
                    if first_silence:
                        self.shot(f"{len(self.steps):02d}-seeding-not-said-yet-tasks")
                    if silent_since is None:
                        silent_since = time.monotonic()
                    self.nav("Dashboard")
                    if page.locator("#demo-status").count():
                        continue
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the demo was not seeded in {timeout_s:.0f} s; the page said {said}")
                page.wait_for_timeout(3000)
                page.reload()
            if silent_since is not None:
                silent_s += time.monotonic() - silent_since
            if silent_s:
                self.trips.append(f"demo seeding: for {silent_s:.0f} s the dashboard said nothing of the seeding "
                                  "and the Tasks page had no task set"
                                  + (" (before the worker's first step)" if said else ""))
            self.figures.update(seeding_said=said, seeding_silent_s=round(silent_s, 1))
            s["detail"] = f"{len(said)} status lines seen; {silent_s:.0f} s with none"

    def find_left_out(self) -> int:
        """The trajectories behind the task set's tasks, from its page; then the first failure of the
        trajectories list that is not one of them."""
        page = self.page
        with self.step("find a left-out failure") as s:
            self.nav("Tasks")
            page.get_by_role("link", name=TASK_SET_NAME).click()
            page.wait_for_load_state()
            in_tasks = {int(m) for m in re.findall(r"trajectory #(\d+)", page.locator("main").inner_text())}
            if not in_tasks:
                raise RuntimeError("the task set's page names no trajectory behind its tasks")
            self.nav("Trajectories")
            page.locator('a[data-tab-outcome="failure"]').click()
            page.wait_for_selector('.results-inner[data-outcome="failure"]')
            pages_read, failures_seen = 1, 0
            while True:
                ids = [int(i.removeprefix("row-")) for i in
                       page.locator("tbody#rows tr").evaluate_all("rows => rows.map(r => r.id)")]
                failures_seen += len(ids)
                left = [i for i in ids if i not in in_tasks]
                if left:
                    break
                older = page.locator('a[rel="next"]')
                if not older.count():
                    raise RuntimeError(f"every one of the {failures_seen} failures listed is behind a task")
                older.first.click()
                page.wait_for_timeout(1000)
                page.wait_for_load_state()
                pages_read += 1
            chosen = left[0]
            page.locator(f"tr#row-{chosen}").evaluate("row => row.scrollIntoView({block: 'center'})")
            self.figures.update(tasks_behind_trajectories=len(in_tasks), left_out_on_first_page=len(left))
            s["detail"] = (f"#{chosen}: {len(in_tasks)} trajectories behind tasks; {len(left)} of the "
                           f"{len(ids)} failures on list page {pages_read} are not")
            return chosen

    def promote_failure(self, trajectory_id: int) -> None:
        page = self.page
        with self.step("open the failure") as s:
            page.locator(f"tr#row-{trajectory_id} a.title").click()
            page.wait_for_url(re.compile(rf"/t/{trajectory_id}/"))
            external_id = page.locator(".subhead .mono").first.inner_text().strip()
            wanted = correct_call(external_id)
            shown = page.locator(".conversation").inner_text()
            if wanted["request"] not in shown:
                raise RuntimeError(f"{external_id}'s request {wanted['request']!r} is not on its page: the demo's "
                                   "requests are no longer generate_tasks(300, seed=21, ...)")
            self.figures.update(trajectory=trajectory_id, external_id=external_id, request=wanted["request"])
            s["detail"] = f"{external_id}: {wanted['request']}"
        with self.step("promote form") as s:
            page.locator("#promote").click()
            page.wait_for_selector("#f-expected-calls")
            prefill = page.locator("#f-expected-calls").input_value()
            self.figures["prefilled_call"] = prefill
            s["detail"] = "prefilled " + " ".join(prefill.split())
        with self.step("run checks") as s:
            target = page.locator("#f-target")
            labels = target.locator("option").all_inner_texts()
            if REGRESSION_LABEL not in labels:
                raise RuntimeError(f"no {REGRESSION_LABEL!r} among the targets {labels}")
            target.select_option(label=REGRESSION_LABEL)
            expected = [wanted["call"]]
            if json.loads(prefill or "[]") == expected:
                self.trips.append("the prefilled call is already the correct one: the failure is not in the call")
            page.locator("#f-expected-calls").fill(json.dumps(expected, indent=2))
            t0 = time.monotonic()
            page.locator("#run-checks").click()
            page.wait_for_selector("#check-reference, #conflicts, #not-saved, .field-error", timeout=120_000)
            self.figures["run_checks_s"] = round(time.monotonic() - t0, 1)
            if page.locator("#conflicts").count():
                raise RuntimeError("refused by the leakage guard: " + page.locator("#conflicts").inner_text())
            original = page.locator("#check-original").get_attribute("data-passed")
            reference = page.locator("#check-reference").get_attribute("data-passed")
            if original != "false" or reference != "true":
                raise RuntimeError(f"the verifier should fail the original and pass the reference: original "
                                   f"passed={original}, reference passed={reference}")
            if page.locator("#leakage-confirm").count():
                doubt = page.locator("#leakage-confirm li").first.inner_text()
                self.trips.append(f"the leakage guard was unsure: {doubt}")
                page.locator("#f-leakage-reason").fill("A request left out of the task set on purpose by the demo")
            s["detail"] = f"original fails, reference passes ({self.figures['run_checks_s']} s for the checks)"
        with self.step("save the case") as s:
            t0 = time.monotonic()
            page.locator("#save").click()
            page.wait_for_url(re.compile(rf"/p/{SLUG}/evals/\d+/"), timeout=120_000)
            self.figures["save_s"] = round(time.monotonic() - t0, 1)
            versions = page.locator("[data-version]").evaluate_all("els => els.map(e => e.dataset.version)")
            s["detail"] = f"{page.url} · versions {', '.join(versions)} ({self.figures['save_s']} s)"

    def train(self, *, measure_timeout_s: float, job_timeout_s: float) -> dict[str, Any]:
        page = self.page
        with self.step("training: one click") as s:
            self.nav("Training")
            page.wait_for_selector("#start-job")
            chosen = {name: page.locator(f"#{name} option:checked").inner_text()
                      for name in ("task-set-version", "holdout-version", "regression-version", "algorithm")}
            self.figures["form_defaults"] = chosen
            self.shot(f"{len(self.steps):02d}-training-form-before-the-click")
            if not chosen["task-set-version"].strip() or chosen["task-set-version"].startswith("Choose"):
                raise RuntimeError("the form chose no task set by default")
            page.locator("#start-job").click()
            page.wait_for_url(re.compile(rf"/p/{SLUG}/training/\d+/"))
            job_url = re.sub(r"[?#].*$", "", page.url)
            s["detail"] = f"{job_url} · " + " · ".join(f"{k}: {v}" for k, v in chosen.items())

        def progress() -> str:
            state = page.locator("#job-state")
            steps = page.locator(".job-progress span")
            return " · ".join(x.first.inner_text() for x in (state, steps) if x.count())

        with self.step("production measured") as s:
            self.wait_for("#confirm-job, #job-error", timeout_s=measure_timeout_s, job_url=job_url, say=progress)
            if page.locator("#job-error").count():
                raise RuntimeError("the job failed: " + page.locator("#job-error").inner_text())
            advice = page.locator("#advice").inner_text() if page.locator("#advice").count() else ""
            before = re.search(r"Success\s+([0-9.]+)", advice)
            self.figures["advice"] = " ".join(advice.split())
            self.figures["production_measured"] = float(before.group(1)) if before else None
            s["detail"] = f"production success {self.figures['production_measured']}"
        with self.step("start training") as s:
            page.locator("#confirm-job").click()
            page.wait_for_load_state()
            s["detail"] = progress()
        with self.step("job ended") as s:
            self.wait_for("#gate-verdict, #job-error", timeout_s=job_timeout_s, job_url=job_url, say=progress)
            if page.locator("#job-error").count():
                raise RuntimeError("the job failed: " + page.locator("#job-error").inner_text())
            s["detail"] = progress()
        return {"job_url": job_url}

    def gate(self) -> bool:
        page = self.page
        with self.step("gate report") as s:
            page.get_by_role("link", name="the report, rule by rule").click()
            page.wait_for_selector("#verdict")
            verdict = page.locator("#verdict").inner_text().strip()
            rules = {}
            for row in page.locator("#gate-rules tbody tr").all():
                cells = [c.strip() for c in row.locator("td").all_inner_texts()]
                if len(cells) >= 4:
                    rules[cells[0]] = {"production": cells[1], "candidate": cells[2], "result": cells[3],
                                       "why": cells[4] if len(cells) > 4 else ""}
            success = rules.get("holdout success", {})

            def number(text: str | None) -> float | None:
                try:
                    return float(text) if text else None
                except ValueError:
                    return None

            promote = page.locator("#promote")
            box = promote.bounding_box() if promote.count() else None
            self.figures.update(gate=verdict, holdout_before=number(success.get("production")),
                                holdout_after=number(success.get("candidate")),
                                refused_by=[n for n, r in rules.items() if r["result"] != "pass"],
                                gate_rules={n: f"{r['production']} -> {r['candidate']} {r['result']}"
                                            for n, r in rules.items()},
                                promote_in_first_screen=bool(box and box["y"] + box["height"] <= VIEWPORT["height"]))
            heading = page.locator("h1").first.inner_text()
            found = re.search(r"v(\d+) against v(\d+)", heading)
            if found:
                self.figures.update(candidate=int(found.group(1)), production_before=int(found.group(2)))
            s["detail"] = (f"{verdict}: holdout {self.figures['holdout_before']} -> {self.figures['holdout_after']}"
                           + (f"; refused by {', '.join(self.figures['refused_by'])}" if verdict != "passed" else ""))
        if verdict != "passed":
            with self.step("gate passed"):
                raise RuntimeError(f"the gate refused the one click's candidate: {self.figures['gate_rules']}")
        return True

    def promote_rollback_canary(self, percent: int) -> None:
        page = self.page
        candidate, previous = self.figures["candidate"], self.figures["production_before"]
        with self.step("promote") as s:
            t0 = time.monotonic()
            page.locator("#promote").click()
            page.wait_for_url(re.compile(rf"/p/{SLUG}/models/"), timeout=120_000)
            self.figures["promote_s"] = round(time.monotonic() - t0, 1)
            production = page.locator("#alias-production .reg-version").inner_text().strip()
            if production != f"v{candidate}":
                raise RuntimeError(f"production is {production} after promoting v{candidate}")
            s["detail"] = f"production {production} ({self.figures['promote_s']} s)"
        with self.step("roll back") as s:
            row = page.locator(f"tr#version-{previous}")
            row.scroll_into_view_if_needed()
            row.get_by_role("button", name="Roll back to this").click()
            page.wait_for_url(re.compile(r"done=rolled-back"))
            production = page.locator("#alias-production .reg-version").inner_text().strip()
            if production != f"v{previous}":
                raise RuntimeError(f"production is {production} after rolling back to v{previous}")
            s["detail"] = f"production {production}"
        with self.step("start as canary") as s:
            row = page.locator(f"tr#version-{candidate}")
            row.scroll_into_view_if_needed()
            offered = row.locator("button").all_inner_texts()
            self.figures["offered_after_rollback"] = offered
            if not row.locator(f"#canary-start-{candidate}").count():
                raise RuntimeError(f"v{candidate}'s row offers {offered}, no Start as canary")
            row.locator("input[name=percent]").fill(str(percent))
            row.locator(f"#canary-start-{candidate}").click()
            page.wait_for_url(re.compile(r"done=canary"))
            serving = " ".join(page.locator("#canary-split").inner_text().split())
            if f"v{candidate}" not in serving or f"{percent}%" not in serving:
                raise RuntimeError(f"the page does not say v{candidate} serves {percent}%: {serving!r}")
            self.figures["canary"] = serving
            s["detail"] = serving


def walk_once(number: int, *, browser: Any, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"walk": number, "screenshots": str(out)}
    platform = None
    scratch = None
    walk: Walk | None = None
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    page.set_default_timeout(30_000)
    walk = Walk(number, page, out, args.url or "")
    try:
        if args.url:
            base_url = args.url
            login = json.loads(Path(args.login).read_text())
        else:
            scratch = Path(tempfile.mkdtemp(prefix=f"flywheel-walk-{number}-", dir=args.workdir))
            platform = Platform(args.run_command, scratch / "var", args.port or free_port(), out / "make-run.log")
            with walk.step("make run") as s:
                base_url, login = platform.start(args.start_timeout)
                s["detail"] = f"{base_url} (var {scratch / 'var'})"
        walk.base_url = base_url.rstrip("/")
        walk.log_in(login)
        walk.open_project()
        walk.wait_seeded(args.seed_timeout)
        chosen = walk.find_left_out()
        walk.promote_failure(chosen)
        walk.train(measure_timeout_s=args.measure_timeout, job_timeout_s=args.job_timeout)
        walk.gate()
        walk.promote_rollback_canary(args.canary_percent)
        result["ok"] = True
    except WalkFailed as failed:
        result.update(ok=False, failed_step=failed.step, failed_url=failed.url, error=failed.error,
                      failed_screenshot=failed.screenshot)
    finally:
        context.close()
        if platform is not None:
            t0 = time.monotonic()
            stopped = platform.stop()
            # `make` itself dies of the SIGINT it is sent, as at a terminal (exit -2 here); what counts is that
            # runlocal stopped its children and said so, and that nothing had to be killed.
            said_stopped = "Stopped." in platform.log.read_text(errors="replace")[-2000:]
            walk.steps.append({"step": "stop make run", "seconds": round(time.monotonic() - t0, 1),
                               "ok": said_stopped and not stopped.get("killed"), **stopped})
            if not walk.steps[-1]["ok"]:
                result.update(ok=False, failed_step="stop make run", failed_url="", failed_screenshot="",
                              error=f"make run did not stop cleanly: {stopped}; see {platform.log}")
            print(f"walk {number} {len(walk.steps):2d} {'stop make run':<28} {walk.steps[-1]['seconds']:8.1f} s  "
                  f"exit {stopped.get('exit')}{' (killed)' if stopped.get('killed') else ''}", flush=True)
            if scratch is not None and not args.keep:
                shutil.rmtree(scratch, ignore_errors=True)
    result.update(steps=[{k: v for k, v in step.items() if k != "screenshot"} for step in walk.steps],
                  seconds=round(sum(step.get("seconds", 0) for step in walk.steps), 1), **walk.figures,
                  trips=walk.trips, dialogs=walk.dialogs, console_errors=walk.console_errors,
                  failed_requests=walk.failed_requests)
    if scratch is not None and args.keep:
        result["var"] = str(scratch / "var")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--walks", type=int, default=1, help="walks, each from a fresh `make run` (default 1)")
    parser.add_argument("--out", help="folder for the screenshots and make run's log (default: a new temporary one)")
    parser.add_argument("--url", help="walk a platform already running at this address instead of starting one")
    parser.add_argument("--login", help="with --url: its var/local-login.json")
    parser.add_argument("--run-command", default="make run", help="what starts the platform (default: make run)")
    parser.add_argument("--port", type=int, help="FLYWHEEL_PORT for make run (default: a free one)")
    parser.add_argument("--workdir", help="where the walks' var folders go (default: the system's temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep each walk's var folder")
    parser.add_argument("--canary-percent", type=int, default=20, help="the canary's weight typed on the Models page")
    parser.add_argument("--start-timeout", type=float, default=600, help="seconds for make run to print its address")
    parser.add_argument("--seed-timeout", type=float, default=1800, help="seconds for the worker to seed the demo")
    parser.add_argument("--measure-timeout", type=float, default=1800, help="seconds to measure production")
    parser.add_argument("--job-timeout", type=float, default=5400, help="seconds for the training job and its gate")
    args = parser.parse_args()
    if args.url and not args.login:
        parser.error("--url needs --login (the platform's var/local-login.json)")
    if args.url and args.walks != 1:
        parser.error("--url walks once: a second walk on the same platform would not start from scratch")
    sys.path.insert(0, str(ROOT))  # trainer.envs.workplace, for the call a newcomer types
    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("CHROMIUM_PATH") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        # As bench/gpu_check.py skips what the machine lacks, so that `make bench` goes on: said, not hidden.
        print(json.dumps({"skipped": "Chromium is not installed (apt-get install -y chromium), or set CHROMIUM_PATH"}))
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="flywheel-newcomer-walk-"))
    print(f"screenshots and logs in {out}", flush=True)
    walks = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            for number in range(1, args.walks + 1):
                walks.append(walk_once(number, browser=browser, out=out / f"walk-{number}", args=args))
                if not walks[-1]["ok"]:
                    break
        finally:
            browser.close()
    passed = sum(1 for w in walks if w["ok"])
    failed = next((w for w in walks if not w["ok"]), None)
    if failed:
        print(f"FAILED: walk {failed['walk']}, step {failed['failed_step']!r} at {failed['failed_url']}: "
              f"{failed['error']} (screenshot {failed['failed_screenshot']})", file=sys.stderr, flush=True)
    print(json.dumps({"walks": walks, "passed": passed, "out": str(out)}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
