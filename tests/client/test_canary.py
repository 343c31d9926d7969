"""The canary through the client and the CLI against the live test server: start a version at a share of
traffic, read the split a router applies and the running check, see both in `flywheel status`, and decide."""

from __future__ import annotations

import pytest
from flywheel_client import ApiError, Flywheel
from flywheel_client import cli as flywheel_cli

from tests.platform.registry.worlds import versions_with_adapters


@pytest.fixture
def two_versions(project, user, tmp_path):
    return versions_with_adapters(project, user, tmp_path)


def test_a_script_starts_reads_and_ends_a_canary(live_server, project, two_versions, make_api_key, monkeypatch,
                                                 capsys):
    read = make_api_key(project, scopes=["read"])
    promote = make_api_key(project, scopes=["promote", "read"])
    with Flywheel(live_server.url, read) as fw:
        with pytest.raises(ApiError) as refused:
            fw.canary(2)
        assert refused.value.status_code == 403
    with Flywheel(live_server.url, promote) as admin:
        started = admin.canary(2, weight=0.2, reason="try v2")
        assert (started.move.alias, started.move.to_version, started.move.weight) == ("canary", 2, 0.2)
        assert (started.check.kind, started.check.status, started.check.baseline_version) == ("canary", "running", 1)
        split = admin.serving()
        assert split["production"]["adapter"] == f"{project.slug}-v1"
        assert (split["canary"]["adapter"], split["canary"]["weight"]) == (f"{project.slug}-v2", 0.2)
        assert [c.kind for c in admin.live_checks()] == ["canary"]

    monkeypatch.setenv("FLYWHEEL_URL", live_server.url)
    monkeypatch.setenv("FLYWHEEL_API_KEY", promote)
    assert flywheel_cli.main(["status"]) == 0
    out = capsys.readouterr().out
    assert out.index("production: version 1") < out.index("canary: version 2") and "serves 20% of traffic" in out
    assert "canary of version 2 against 1: running" in out

    assert flywheel_cli.main(["canary", "rollback", "--reason", "not now"]) == 0
    assert capsys.readouterr().out.startswith("canary ended: version 2 no longer serves")
    with Flywheel(live_server.url, read) as fw:
        assert fw.serving()["canary"] is None
        assert fw.live_checks()[0].status != "running"
    assert flywheel_cli.main(["canary", "soon"]) == 2
    assert "expected a version number" in capsys.readouterr().err
