"""compose.yaml scales out (`docker compose up --scale prefill=2 --scale decode=2`): nothing
pins an engine to one container (container_name, published ports, a fixed advertise
address) and the gateway finds the replicas through Redis, not by service name.
`scripts/compose_smoke.sh` runs the scaled stack for real where Docker runs."""

from __future__ import annotations

from tests.services.launcher.test_compose import ENGINES, _config


def test_engine_services_can_have_replicas():
    services = _config()["services"]
    for name in (*ENGINES, *(f"{e}-gpu" for e in ENGINES)):
        s = _config("--profile", "gpu")["services"][name] if name.endswith("-gpu") \
            else services[name]
        assert "container_name" not in s, name
        assert not s.get("ports"), f"{name} publishes a host port: replicas would collide"
        assert "PDSERVE_ADVERTISE_ADDRESS" not in s.get("environment", {}), \
            f"{name}: each replica derives its own address (its container IP)"
        assert s["command"][s["command"].index("--host") + 1] == "0.0.0.0", name
        assert "127.0.0.1" in " ".join(s["healthcheck"]["test"]), name  # the container's own


def test_the_gateway_finds_the_engines_through_redis_only():
    command = _config()["services"]["gateway"]["command"]
    assert "--redis-url" in command
    assert "--prefill-url" not in command and "--decode-url" not in command
