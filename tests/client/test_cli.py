"""The `flywheel` command's exit codes for a job that fails and for a wait that times out, against a stand-in
server, and what it sends: the latest version when none is named, `--config` values read as JSON."""

from __future__ import annotations

import itertools

import pytest
from flywheel_client import cli

VERSION = {"api_version": "1", "platform_version": "0.1.0"}


def training_server(stand_in, statuses):
    states = itertools.chain(statuses, itertools.repeat(statuses[-1]))

    def handler(request):
        if request.path == "/api/v1/version":
            return 200, {}, VERSION
        if request.path == "/api/v1/task-sets/3/versions":
            return 200, {}, [{"number": 2, "content_hash": "b" * 64, "size": 12, "note": "", "export_url": ""},
                             {"number": 1, "content_hash": "a" * 64, "size": 10, "note": "", "export_url": ""}]
        if request.path == "/api/v1/training-jobs" and request.method == "POST":
            return 201, {}, {"id": 9, "status": "evaluating"}
        if request.path == "/api/v1/training-jobs/9":
            status = next(states)
            failed = status == "failed"
            return 200, {}, {"id": 9, "status": status, "step": 1, "max_steps": 20, "progress": 0.05,
                             "failed_step": 1 if failed else None,
                             "error": "the trainer ran out of memory" if failed else "", "gate": None}
        return 404, {}, {"detail": "Not Found"}

    return stand_in(handler)


def test_a_failed_job_exits_4_with_its_step_and_error(stand_in, capsys):
    server = training_server(stand_in, ["running", "failed"])
    code = cli.main(["--url", server.url, "--key", "k", "train", "--task-set", "3", "--config", "max_steps=20",
                     "--config", "loss_type=dr_grpo", "--config", "learning_rate=1e-3", "--wait"])
    out, err = capsys.readouterr()
    assert code == cli.JOB_FAILED == 4, (out, err)
    assert "training job 9 failed at step 1: the trainer ran out of memory" in err
    [start] = [r for r in server.requests if r.method == "POST"]
    assert start.body == {"task_set": 3, "task_set_version": 2, "algorithm": "grpo", "confirm": True,
                          "config": {"max_steps": 20, "loss_type": "dr_grpo", "learning_rate": 0.001}}


def test_a_wait_past_its_timeout_exits_5_and_leaves_the_job_running(stand_in, capsys):
    server = training_server(stand_in, ["running"])
    code = cli.main(["--url", server.url, "--key", "k", "train", "--task-set", "3:1", "--wait", "--timeout", "0"])
    out, err = capsys.readouterr()
    assert code == cli.TIMED_OUT == 5, (out, err)
    assert "Training job 9 is still running after 0s." in err
    assert not any(r.path.endswith("/cancel") for r in server.requests)
    [start] = [r for r in server.requests if r.method == "POST"]
    assert start.body["task_set_version"] == 1
    assert not any(r.path.endswith("/versions") for r in server.requests)  # a named version is not looked up


def test_a_wrong_option_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--task-set", "three"])
    assert exc.value.code == cli.USAGE == 2
    assert "'three': expected ID or ID:VERSION" in capsys.readouterr().err


def test_rollback_sends_its_reason_and_prints_the_move(stand_in, capsys):
    move = {"alias": "production", "kind": "rollback", "from_version": 7, "to_version": 5, "user": "ci-bot",
            "reason": "tickets rose", "at": "2026-12-04T08:00:00Z"}
    server = stand_in(lambda request: (200, {}, VERSION if request.path == "/api/v1/version" else move))
    code = cli.main(["--url", server.url, "--key", "k", "rollback", "--to", "5", "--reason", "tickets rose"])
    out, err = capsys.readouterr()
    assert (code, err) == (cli.OK, "")
    assert out == "production rollback: version 7 -> 5 by ci-bot at 2026-12-04T08:00:00Z: tickets rose\n"
    assert [(r.method, r.path, r.body) for r in server.requests[1:]] == [
        ("POST", "/api/v1/models/production/rollback", {"reason": "tickets rose", "to_version": 5})]


def test_without_a_key_the_command_says_which_setting_is_missing(monkeypatch, capsys):
    monkeypatch.delenv("FLYWHEEL_API_KEY", raising=False)
    assert cli.main(["--url", "http://127.0.0.1:9", "status"]) == cli.USAGE
    assert "set FLYWHEEL_API_KEY or pass --key" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["localhost:8031", "ftp://flywheel.example.com", "http://"])
def test_a_server_address_without_http_is_refused_at_once_saying_what_to_write(url, monkeypatch, capsys):
    monkeypatch.setenv("FLYWHEEL_URL", url)
    code = cli.main(["--key", "k", "status"])
    out, err = capsys.readouterr()
    assert code == cli.ERROR, (out, err)
    assert f"FLYWHEEL_URL {url!r} is not an http:// or https:// address of a server" in err
    if url == "localhost:8031":
        assert "e.g. http://localhost:8031" in err
    assert "retr" not in err.lower()  # refused before any request, not after retries


def test_a_first_canary_prints_the_version_and_its_share_not_a_move_from_none(stand_in, capsys):
    start = {"move": {"alias": "canary", "kind": "set", "from_version": None, "to_version": 3, "weight": 0.1,
                      "user": "ana", "at": "2026-12-04T08:00:00Z"},
             "check": {"id": 1, "kind": "canary", "status": "running", "subject_version": 3, "baseline_version": 2}}
    server = stand_in(lambda request: (200, {}, VERSION if request.path == "/api/v1/version" else start))
    code = cli.main(["--url", server.url, "--key", "k", "canary", "3"])
    out, err = capsys.readouterr()
    assert (code, err) == (cli.OK, "")
    first = out.splitlines()[0]
    assert first == "canary set: version 3 at 10% of traffic by ana at 2026-12-04T08:00:00Z"
    assert "None" not in out
