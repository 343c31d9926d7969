"""The production stack (docker-compose.yml, Dockerfile) is wired as the README says. No Docker engine
runs here, so this reads the files: services, dependencies, hosts in the environment, queues, the GPU."""

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SERVICES = {"postgres", "redis", "mlflow", "web", "worker", "gpu-worker"}
APP_SERVICES = ("web", "worker", "gpu-worker")


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def services(compose):
    return compose["services"]


def _command(service) -> str:
    command = service.get("command", "")
    return command if isinstance(command, str) else " ".join(command)


def _depends(service) -> dict:
    depends = service.get("depends_on", {})
    return depends if isinstance(depends, dict) else {name: {"condition": "service_started"} for name in depends}


def test_the_stack_has_its_services(services):
    assert set(services) == SERVICES


def test_every_service_has_a_healthcheck(services):
    for name, service in services.items():
        check = service.get("healthcheck", {})
        assert check.get("test"), f"{name} has no healthcheck"
        assert not check.get("disable"), name


def test_app_services_run_in_production_mode_pointed_at_the_stack(services):
    for name in APP_SERVICES:
        env = services[name]["environment"]
        assert env["FLYWHEEL_ENV"] == "production", name
        assert env["SECRET_KEY"].startswith("${SECRET_KEY:?"), f"{name}: SECRET_KEY must come from the environment, required"
        assert re.fullmatch(r"postgres://flywheel:\$\{POSTGRES_PASSWORD:\?[^}]*\}@postgres:5432/flywheel", env["DATABASE_URL"]), name
        assert env["CELERY_BROKER_URL"] == "redis://redis:6379/0", name
        assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000", name


def test_no_secret_is_written_into_the_file():
    text = (REPO / "docker-compose.yml").read_text()
    for variable in ("SECRET_KEY", "POSTGRES_PASSWORD"):
        for match in re.finditer(rf"{variable}: (\S+)", text):
            assert match.group(1).startswith("${"), f"{variable} has a literal value"


def test_app_services_wait_for_healthy_dependencies(services):
    for name, needs in {
        "mlflow": {"postgres"},
        "web": {"postgres", "redis", "mlflow"},
        "worker": {"postgres", "redis", "web"},
        "gpu-worker": {"postgres", "redis", "mlflow", "web"},
    }.items():
        depends = _depends(services[name])
        assert needs <= set(depends), f"{name} depends on {sorted(depends)}, needs {sorted(needs)}"
        for dependency in needs:
            assert depends[dependency]["condition"] == "service_healthy", f"{name} -> {dependency}"


def test_mlflow_keeps_runs_in_postgresql_and_artifacts_on_a_volume(compose, services):
    mlflow = services["mlflow"]
    command = _command(mlflow)
    assert re.search(r"--backend-store-uri[= ]postgresql(\+psycopg)?://flywheel:[^@]+@postgres:5432/mlflow", command)
    assert "--serve-artifacts" in command
    destination = re.search(r"--artifacts-destination[= ](\S+)", command).group(1)
    volumes = {v.split(":")[1]: v.split(":")[0] for v in mlflow["volumes"]}
    assert volumes[destination] in compose["volumes"], "artifacts must live on a named volume"
    init = [v for v in services["postgres"]["volumes"] if "docker-entrypoint-initdb.d" in v]
    source = REPO / init[0].split(":")[0]
    assert "CREATE DATABASE mlflow" in source.read_text()


def test_web_serves_with_gunicorn_after_migrating(services):
    command = _command(services["web"])
    assert "manage.py migrate" in command
    assert "gunicorn flywheel.wsgi" in command
    assert any(str(port).endswith(":8000") for port in services["web"]["ports"])
    assert "/healthz" in " ".join(services["web"]["healthcheck"]["test"])


def test_workers_consume_their_queues(services):
    worker, gpu = _command(services["worker"]), _command(services["gpu-worker"])
    assert "celery -A flywheel worker" in worker and "celery -A flywheel worker" in gpu
    assert re.search(r"-Q default(\s|$)", worker)
    assert re.search(r"-Q gpu(\s|$)", gpu)


def test_the_gpu_worker_reserves_nvidia_gpus_and_installs_the_gpu_extra(services):
    gpu = services["gpu-worker"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert gpu["build"]["args"]["EXTRAS"] == "gpu"
    for name in ("web", "worker"):
        assert "deploy" not in services[name], f"{name} must not hold a GPU"
        assert "EXTRAS" not in (services[name].get("build", {}).get("args") or {}), name


def test_the_dockerfile_installs_torch_first_then_the_extras():
    dockerfile = (REPO / "Dockerfile").read_text()
    torch_at = dockerfile.index("torch==2.13.0")
    extras_at = dockerfile.index('pip install -e ".${EXTRAS:+[${EXTRAS}]}"')
    assert torch_at < extras_at
    assert "ARG EXTRAS" in dockerfile
    assert "collectstatic" in dockerfile
    assert re.search(r"^USER (?!root)\w+", dockerfile, re.M), "the image must not run as root"


def test_static_files_are_collected_where_production_serves_them(services):
    """The image collects into FLYWHEEL_STATIC_ROOT and the running containers serve from the same folder,
    which no volume hides (production serves collected files only: no finders)."""
    dockerfile = (REPO / "Dockerfile").read_text()
    declared = re.search(r"FLYWHEEL_STATIC_ROOT=(\S+)", dockerfile)
    assert declared, "the Dockerfile must set FLYWHEEL_STATIC_ROOT in its ENV"
    static_root = declared.group(1)
    collect = next(line for line in dockerfile.split("RUN ") if "collectstatic" in line)
    assert "FLYWHEEL_STATIC_ROOT" not in collect, "collectstatic must write where the runtime reads"
    assert re.search(rf"^ENV (.*\\\n)*.*FLYWHEEL_STATIC_ROOT={re.escape(static_root)}", dockerfile, re.M)
    for name in APP_SERVICES:
        env = services[name]["environment"]
        assert env.get("FLYWHEEL_STATIC_ROOT", static_root) == static_root, name
        for volume in services[name].get("volumes", []):
            target = volume.split(":")[1]
            assert not (static_root + "/").startswith(target.rstrip("/") + "/"), f"{name}: {volume} hides {static_root}"
