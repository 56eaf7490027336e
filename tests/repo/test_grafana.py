"""deploy/grafana/pdserve.json decodes into Grafana's own dashboard model (grafana-foundation-sdk,
generated from Grafana's schema) for the schemaVersion it declares, with nothing unknown or
mistyped, and queries only metrics the services expose; the Prometheus
scrape config and the monitoring compose file fit the compose stack. (The real stack's
/metrics are checked against the same queries in tests/e2e/test_dashboard.py.)"""

from __future__ import annotations

import enum
import importlib.metadata
import json
import re
import subprocess
import types
import typing
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pdserve.services.common.metrics import ServiceMetrics
from pdserve.services.common.tier_metrics import TierMetrics
from pdserve.services.gateway.metrics import GatewayMetrics

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
    tiers = CollectorRegistry()  # made at an engine's first tier snapshot (with a disk tier)
    TierMetrics("m", tiers)
    registries = [ServiceMetrics("m", CollectorRegistry()).registry, GatewayMetrics().registry,
                  tiers]
    names = set()
    for registry in registries:
        for family in registry.collect():
            names.update(family.name + s for s in _SUFFIXES.get(family.type, ("",)))
    return names


# Import-only fields of an exported dashboard: Grafana's import dialog reads and drops them,
# so its dashboard schema has none of them.
_IMPORT_ENVELOPE = ("__inputs", "__requires")


def _unknown_fields(given, decoded, path: str = "$") -> list[str]:
    """Paths of `given`'s fields that the SDK's model dropped or changed on the way through
    from_json/to_json (from_json keeps only the fields it knows). A null the model omits
    counts as kept."""
    if isinstance(given, dict) and isinstance(decoded, dict):
        return [e for k, v in given.items() if not (v is None and k not in decoded)
                for e in (_unknown_fields(v, decoded[k], f"{path}.{k}") if k in decoded
                          else [f"{path}.{k}: not in Grafana's schema"])]
    if isinstance(given, list) and isinstance(decoded, list) and len(given) == len(decoded):
        return [e for i, (g, d) in enumerate(zip(given, decoded))
                for e in _unknown_fields(g, d, f"{path}[{i}]")]
    same = given == decoded and type(given) is type(decoded)
    return [] if same else [f"{path}: {given!r} decodes as {decoded!r}"]


def _type_errors(value, hint, path: str) -> list[str]:
    """Where `value` (as from_json left it: raw JSON values inside SDK model objects) does
    not have the type the SDK's annotation `hint` gives (from_json itself checks nothing)."""
    from grafana_foundation_sdk.cog.runtime import UnknownDataquery

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        tries = [_type_errors(value, arm, path) for arm in args]
        if any(not errors for errors in tries):
            return []
        return max(tries, key=lambda errors: max(len(e.split(":")[0]) for e in errors))
    if isinstance(value, UnknownDataquery):
        return [f"{path}: a query of a datasource type the SDK does not know"]
    is_model = type(value).__module__.startswith("grafana_foundation_sdk.models.")
    if hint in (typing.Any, object):
        return _model_errors(value, path) if is_model else []
    if origin is list or origin is dict:
        if not isinstance(value, origin):
            return [f"{path}: {value!r} is not a {origin.__name__}"]
        items = enumerate(value) if origin is list else value.items()
        return [e for k, v in items for e in _type_errors(v, args[-1], f"{path}[{k!r}]")]
    if origin is typing.Literal:
        ok = any(value == a and type(value) is type(a) for a in args)
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        ok = not isinstance(value, bool) and value in {m.value for m in hint}
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint in (int, str, bool, type(None)):
        ok = type(value) is hint
    elif isinstance(hint, type):
        return _model_errors(value, path) if isinstance(value, hint) else \
            [f"{path}: {value!r} is not a {hint.__name__}"]
    else:
        return [f"{path}: cannot check the type {hint}"]
    return [] if ok else [f"{path}: {value!r} is not {hint}"]


def _model_errors(model, path: str) -> list[str]:
    hints = typing.get_type_hints(type(model))
    return [e for name, hint in hints.items()
            for e in _type_errors(getattr(model, name), hint, f"{path}.{name}")]


def _schema_findings(board: dict):
    """Decode `board` with the SDK's Dashboard model; returns (the model, the unknown and
    the mistyped fields)."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()  # panel options, field configs, Prometheus queries
    model = Dashboard.from_json(board)
    decoded = json.loads(json.dumps(model, cls=JSONEncoder))
    body = {k: v for k, v in board.items() if k not in _IMPORT_ENVELOPE}
    return model, _unknown_fields(body, decoded) + _model_errors(model, "$")


def test_grafanas_dashboard_schema_decodes_every_field_with_its_type():
    """The SDK's Dashboard model (Grafana 11.6's dashboard kind; panel options, field configs
    and Prometheus queries decoded by their plugins' models) knows every field of the JSON,
    and every value has the type it declares. The declared schemaVersion is the one that
    Grafana version writes (41). 11.6 is the SDK's newest release for a released Grafana (its
    unversioned "next" builds track Grafana's main branch); a newer Grafana (the compose image
    is 12.1) migrates an older schemaVersion forward on import. 39 -> 41 was lossless here:
    v40 only defaults a non-string `refresh`, v41 only drops `timepicker.time_options`."""
    pytest.importorskip("grafana_foundation_sdk")
    from grafana_foundation_sdk.models import dashboard as grafana
    from grafana_foundation_sdk.models import prometheus

    given = dashboard()
    board, findings = _schema_findings(given)
    assert findings == []
    sdk_grafana = importlib.metadata.version("grafana-foundation-sdk").split("!")[-1]
    assert sdk_grafana == "11.6.0"
    assert given["schemaVersion"] == grafana.Dashboard().schema_version == 41
    requires = {r["id"]: r for r in given["__requires"]}
    assert requires["grafana"]["version"] == sdk_grafana
    assert requires["prometheus"]["type"] == "datasource"
    assert {r["id"] for r in given["__requires"] if r["type"] == "panel"} == \
        {p["type"] for p in given["panels"] if p["type"] != "row"}
    panels = [p for p in board.panels if isinstance(p, grafana.Panel)]
    assert len(panels) == len([p for p in given["panels"] if p["type"] != "row"]) >= 15
    assert len(board.templating.list_val) == len(given["templating"]["list"]) == 3
    for panel in panels:  # a panel type the SDK lacks would leave these unchecked dicts
        assert type(panel.options).__module__.endswith(panel.type_val), panel.title
        assert not isinstance(panel.field_config.defaults.custom, dict), panel.title
        assert panel.targets and all(isinstance(t, prometheus.Dataquery) for t in panel.targets)


def test_the_schema_check_reports_unknown_and_mistyped_fields():
    pytest.importorskip("grafana_foundation_sdk")
    board = dashboard()
    board["panels"][1]["targets"][0]["exprr"] = "up"
    board["panels"][1]["options"]["legend"]["displayMode"] = "lists"
    board["panels"][2]["datasource"]["type"] = "prom"
    del board["panels"][2]["targets"][1:]
    board["templating"]["list"][0]["hide"] = "0"
    board["panels"][1]["gridPos"]["h"] = 8.5
    board["refresh"] = False
    _, findings = _schema_findings(board)
    assert [e.split(":")[0] for e in findings] == [
        "$.panels[1].targets[0].exprr", "$.refresh", "$.panels[1].grid_pos.h",
        "$.panels[1].options.legend.display_mode", "$.panels[2].targets[0]",
        "$.templating.list_val[0].hide"], findings


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
    from tests.services.launcher.test_compose import TOKEN, _compose_binary

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
