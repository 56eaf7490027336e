"""deploy/kubernetes validates against the Kubernetes versions we claim (1.27, the first with
GA gRPC probes, to the newest `kubernetes-validate` knows; strict: no unknown field) and
keeps its contract: discovery through Redis only, grpc.health probes, secrets from a
Secret, resource requests, disruption budgets, and termination grace periods longer than
the services' own drains. Built with `kubectl kustomize` where kubectl is installed, else
from the files the kustomizations list."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e .[dev])")
from kubernetes_validate.utils import all_versions  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
MIN_VERSION = (1, 27)
CLAIMED = [v for v in all_versions()
           if tuple(int(x) for x in v.split(".")[:2]) >= MIN_VERSION]
ENGINE_GRACE_MARGIN_S = 10
"""After the drain (PDSERVE_GRACE_PERIOD) a service closes its worker and engine."""


def _load_kustomization(directory: Path) -> list[dict]:
    """What `kubectl kustomize` would build for our simple kustomizations (resources,
    namespace, images, JSON-patch removals) when kubectl is not installed."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for entry in k.get("resources", []):
        path = directory / entry
        if path.is_dir():
            docs += _load_kustomization(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for d in docs:
        if k.get("namespace") and d["kind"] != "Namespace":
            d["metadata"]["namespace"] = k["namespace"]
    for patch in k.get("patches", []):
        target = patch["target"]
        for d in docs:
            if d["kind"] == target["kind"] and d["metadata"]["name"] in \
                    target["name"].split("|"):
                for op in yaml.safe_load(patch["patch"]):
                    assert op["op"] == "remove", op
                    *parents, last = op["path"].strip("/").split("/")
                    node = d
                    for p in parents:
                        node = node[p]
                    node.pop(last)
    return docs


def build(directory: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return _load_kustomization(directory)
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def base() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in build(KUBE)}


@pytest.fixture(scope="module")
def autoscaling() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in build(KUBE / "autoscaling")}


def test_claimed_versions_are_known_to_the_validator():
    assert CLAIMED and CLAIMED[0].startswith("1.27"), all_versions()


@pytest.mark.parametrize("version", CLAIMED)
def test_every_manifest_validates_strictly(base, autoscaling, version):
    for (kind, name), doc in {**base, **autoscaling}.items():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{kind}/{name} on {version}: {e.message} at {list(e.path)}")


def test_the_stack_is_complete(base):
    assert set(base) == {
        ("Namespace", "pdserve"), ("Secret", "pdserve-secrets"),
        ("Deployment", "redis"), ("Service", "redis"),
        ("Deployment", "prefill"), ("Deployment", "decode"),
        ("Deployment", "gateway"), ("Service", "gateway"),
        ("PodDisruptionBudget", "prefill"), ("PodDisruptionBudget", "decode"),
        ("PodDisruptionBudget", "gateway")}
    assert {d["metadata"].get("namespace") for k, d in base.items() if k[0] != "Namespace"} \
        == {"pdserve"}
    for role in ("prefill", "decode", "gateway"):
        assert base[("Deployment", role)]["spec"]["replicas"] >= 2, role


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _secret_ref(env: dict, name: str) -> tuple[str, str]:
    ref = env[name]["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def _redis_url(base) -> str:
    (port,) = base[("Service", "redis")]["spec"]["ports"]
    return f"redis://redis:{port['port']}/0"


def _parse(command: list[str], env: dict[str, str], monkeypatch):
    """The container's command through the real `pdserve` parser, with its environment."""
    for key in [k for k in os.environ if k.startswith("PDSERVE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from pdserve.services.cli import build_parser

    assert command[0] == "pdserve"
    return build_parser().parse_args(command[1:])


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engines_register_their_pod_ip_and_drain_within_the_grace_period(base, role,
                                                                         monkeypatch):
    deployment = base[("Deployment", role)]
    pod = deployment["spec"]["template"]["spec"]
    c = _container(deployment)
    env = _env(c)
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["PDSERVE_ADVERTISE_ADDRESS"]["value"] == "$(POD_IP)"
    assert list(env).index("POD_IP") < list(env).index("PDSERVE_ADVERTISE_ADDRESS")
    assert env["PDSERVE_REDIS_URL"]["value"] == _redis_url(base)
    assert _secret_ref(env, "PDSERVE_INTERNAL_TOKEN") == ("pdserve-secrets", "internal-token")

    plain = {k: e["value"] for k, e in env.items() if "value" in e}
    plain.update(PDSERVE_ADVERTISE_ADDRESS="10.1.2.3", PDSERVE_INTERNAL_TOKEN="t0k3n")
    ns = _parse(c["command"], plain, monkeypatch)
    from pdserve.services.common.config import config_from_args

    config = config_from_args(ns, role)
    (grpc_port,) = [p["containerPort"] for p in c["ports"] if p["name"] == "grpc"]
    (metrics_port,) = [p["containerPort"] for p in c["ports"] if p["name"] == "metrics"]
    assert (config.host, config.port, config.metrics_port) == ("0.0.0.0", grpc_port,
                                                                metrics_port)
    assert config.resolve_address(grpc_port) == f"10.1.2.3:{grpc_port}"
    assert config.redis_url == _redis_url(base) and config.internal_token == "t0k3n"
    assert pod["terminationGracePeriodSeconds"] >= config.grace_period + ENGINE_GRACE_MARGIN_S

    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": grpc_port}, probe  # grpc.health.v1, service ""
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > \
        pod["terminationGracePeriodSeconds"], "a drain must never trip the liveness probe"
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 300  # loading the model
    assert {"cpu", "memory"} <= set(c["resources"]["requests"])
    assert "memory" in c["resources"]["limits"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(metrics_port)
    (init,) = pod["initContainers"]
    assert init["command"] == ["pdserve", "convert"]


def test_the_gateway_finds_engines_through_redis_only(base, monkeypatch):
    deployment = base[("Deployment", "gateway")]
    pod = deployment["spec"]["template"]["spec"]
    c = _container(deployment)
    env = _env(c)
    assert _secret_ref(env, "PDSERVE_API_KEY") == ("pdserve-secrets", "api-key")
    # the operator's key: without it /dashboard and /debug/* are closed to everyone
    assert _secret_ref(env, "PDSERVE_ADMIN_API_KEY") == ("pdserve-secrets", "admin-api-key")
    assert _secret_ref(env, "PDSERVE_INTERNAL_TOKEN") == ("pdserve-secrets", "internal-token")
    ns = _parse(c["command"], {}, monkeypatch)
    assert ns.redis_url == _redis_url(base)
    assert not ns.prefill_url and not ns.decode_url, "no static instance lists"
    assert ns.host == "0.0.0.0"
    (http,) = c["ports"]
    assert ns.port == http["containerPort"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] in ("/version", "/ping")
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    # uvicorn's own stop comes 3 s after the grace period (services/gateway/__main__.py).
    assert pod["terminationGracePeriodSeconds"] > pre_stop + ns.grace_period + 3
    assert {"cpu", "memory"} <= set(c["resources"]["requests"])
    (service_port,) = base[("Service", "gateway")]["spec"]["ports"]
    assert service_port["targetPort"] == http["name"]


def test_every_secret_key_referenced_is_in_the_secret(base):
    keys = set(base[("Secret", "pdserve-secrets")]["stringData"])
    refs = {e["valueFrom"]["secretKeyRef"]["key"] for (kind, _), d in base.items()
            if kind == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]
            for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs and refs <= keys, refs - keys


def test_services_and_budgets_select_the_pods_they_mean(base):
    pods = {name: d["spec"]["template"]["metadata"]["labels"]
            for (kind, name), d in base.items() if kind == "Deployment"}
    for (kind, name), d in base.items():
        if kind == "Deployment":
            assert d["spec"]["selector"]["matchLabels"].items() <= pods[name].items()
        elif kind == "Service":
            assert d["spec"]["selector"].items() <= pods[name].items()
        elif kind == "PodDisruptionBudget":
            assert d["spec"]["selector"]["matchLabels"].items() <= pods[name].items()
            assert d["spec"]["maxUnavailable"] == 1
    images = {c["image"].split(":")[0] for d in base.values() if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {"pdserve", "pdserve-redis"}


def test_autoscaling_overlay_scales_the_engines_on_their_queue(autoscaling):
    for role in ("prefill", "decode"):
        hpa = autoscaling[("HorizontalPodAutoscaler", role)]
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", role)
        assert ("Deployment", role) in autoscaling
        (metric,) = hpa["spec"]["metrics"]
        assert metric["pods"]["metric"]["name"] == "pdserve_num_requests_waiting"
        assert hpa["spec"]["minReplicas"] >= 2
        assert "replicas" not in autoscaling[("Deployment", role)]["spec"], \
            "an apply would undo the autoscaler's choice"
        assert hpa["metadata"]["namespace"] == "pdserve"


def test_the_engine_metric_the_autoscaler_reads_exists():
    from prometheus_client import CollectorRegistry

    from pdserve.services.common.metrics import ServiceMetrics

    registry = CollectorRegistry()
    ServiceMetrics("m", registry)
    names = {m.name for m in registry.collect()}
    assert "pdserve_num_requests_waiting" in names


def test_the_fallback_loader_matches_kubectl():
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the fallback loader is what runs")
    for directory in (KUBE, KUBE / "autoscaling"):
        built = {(d["kind"], d["metadata"]["name"]) for d in build(directory)}
        loaded = {(d["kind"], d["metadata"]["name"]) for d in _load_kustomization(directory)}
        assert built == loaded
