"""deploy/grafana/pdserve.json imports into Grafana (the fields its import reads, for the
schemaVersion it declares) and queries only metrics the services expose; the Prometheus
scrape config and the monitoring compose file fit the compose stack. (The real stack's
/metrics are checked against the same queries in tests/e2e/test_dashboard.py.)"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from services.common.metrics import ServiceMetrics
from services.gateway.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve.json"
METRIC = re.compile(r"\bpdserve_[A-Za-z0-9_]+")
_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
             "histogram": ("_bucket", "_count", "_sum", "_created")}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queried_metrics(board: dict) -> set[str]:
    """Every pdserve_* name in a panel query or a template variable."""
    text = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    text += [json.dumps(v.get("query", "")) for v in board["templating"]["list"]]
    return {m for t in text for m in METRIC.findall(t)}


def exposed_names() -> set[str]:
    """The sample names the services' registries expose (prometheus_client's suffixes)."""
    registries = [ServiceMetrics("m", CollectorRegistry()).registry, GatewayMetrics().registry]
    names = set()
    for registry in registries:
        for family in registry.collect():
            names.update(family.name + s for s in _SUFFIXES.get(family.type, ("",)))
    return names


def test_every_queried_metric_is_exposed_by_a_service():
    queried = queried_metrics(dashboard())
    assert len(queried) >= 20, queried
    missing = queried - exposed_names()
    assert not missing, f"queried but exposed by no service: {sorted(missing)}"


def test_the_json_has_what_grafana_import_reads():
    board = dashboard()
    assert isinstance(board["schemaVersion"], int) and 36 <= board["schemaVersion"] <= 41
    assert board["title"] and re.fullmatch(r"[A-Za-z0-9_-]{1,40}", board["uid"])
    assert board["id"] is None  # import assigns it
    assert {i["name"] for i in board["__inputs"]} == {"DS_PROMETHEUS"}
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert {"model_name", "instance"} <= set(variables)
    assert board["time"]["from"] and board["time"]["to"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and g["x"] + g["w"] <= 24, p["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"panel {p['title']!r} overlaps another"
        cells |= area
        if p["type"] == "row":
            continue
        assert p["type"] in ("timeseries", "heatmap", "stat", "gauge"), p["type"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert "{{" not in t["expr"], t["expr"]
    titles = " ".join(p["title"] for p in board["panels"]).lower()
    for topic in ("e2e", "time to first token", "inter token", "throughput", "scheduler",
                  "kv cache usage", "prefix cache hit rate", "preemptions",
                  "kv transfer bytes", "kv transfer duration"):
        assert topic in titles, topic


def test_prometheus_scrapes_every_engine_and_the_gateway():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["pdserve-gateway"]["static_configs"][0]["targets"] == ["gateway:8000"]
    for role, port in (("prefill", 9051), ("decode", 9052)):
        sd = jobs[f"pdserve-{role}"]["dns_sd_configs"][0]
        assert (sd["names"], sd["port"]) == ([role], port)
        assert {"target_label": "role", "replacement": role} in \
            jobs[f"pdserve-{role}"]["relabel_configs"]
    compose = (ROOT / "compose.yaml").read_text()
    assert '"--metrics-port", "9051"' in compose and '"--metrics-port", "9052"' in compose


def test_the_monitoring_compose_file_adds_prometheus_and_grafana():
    from tests.launcher.test_compose import TOKEN, _compose_binary

    binary = _compose_binary()
    done = subprocess.run(
        [str(binary), "-f", str(ROOT / "compose.yaml"), "-f",
         str(ROOT / "deploy" / "compose.monitoring.yaml"), "--project-directory", str(ROOT),
         "--env-file", "/dev/null", "--profile", "monitoring", "config", "--format", "json"],
        capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PDSERVE_INTERNAL_TOKEN": TOKEN})
    assert done.returncode == 0, done.stderr
    services = json.loads(done.stdout)["services"]
    assert {"prometheus", "grafana", "gateway", "prefill", "decode"} <= set(services)
    mounts = {v["target"]: Path(v["source"]) for s in ("prometheus", "grafana")
              for v in services[s]["volumes"]}
    assert mounts["/etc/prometheus/prometheus.yml"] == ROOT / "deploy/prometheus/prometheus.yml"
    assert mounts["/var/lib/grafana/dashboards/pdserve.json"] == DASHBOARD
    assert all(p.exists() for p in mounts.values()), mounts
