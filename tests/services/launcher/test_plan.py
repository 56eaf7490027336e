"""The launch plan without starting anything: core split, ports, and command lines that the
real `pdserve serve` parsers accept with the values the launcher meant."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest

from pdserve.services.cli import build_parser
from pdserve.services.launcher.config import add_up_args, config_from_args
from pdserve.services.launcher.cores import distribute, format_cores, split_cores
from pdserve.services.launcher.plan import build_plan, child_env, engine_flags
from pdserve.services.launcher.up import curl_line
from pdserve.shared.engine.core_share import default_board_path
from pdserve.shared.engine_args import EngineArgs


def _config(*argv: str):
    return config_from_args(build_parser().parse_args(["up", *argv]))


@pytest.mark.parametrize("cores,n_p,n_d,prefill,decode", [
    ((0, 1), 1, 1, [(0,)], [(1,)]),
    (tuple(range(8)), 1, 1, [(0, 1, 2, 3)], [(4, 5, 6, 7)]),
    (tuple(range(8)), 2, 1, [(0, 1, 2), (3, 4)], [(5, 6, 7)]),
    ((0, 1), 2, 2, [(0,), (0,)], [(1,), (1,)]),
    ((0,), 1, 1, [(0,)], [(0,)]),
    ((0, 1, 2), 1, 1, [(0, 1)], [(2,)]),
])
def test_split_cores(cores, n_p, n_d, prefill, decode):
    split = split_cores(cores, n_p, n_d)
    assert (split.prefill, split.decode) == (prefill, decode)


def test_split_cores_overrides():
    assert split_cores(range(4), 1, 1, prefill_cores=(0, 1, 2)).decode == [(3,)]
    assert split_cores(range(4), 1, 2, decode_cores=(2, 3)) == ([(0, 1)], [(2,), (3,)])
    assert split_cores(range(2), 1, 1, prefill_cores=(0, 1)).decode == [(0, 1)]


def test_distribute_and_format():
    assert distribute((0, 1, 2, 3, 4), 2) == [(0, 1, 2), (3, 4)]
    assert distribute((), 2) == [(), ()]
    assert format_cores((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert format_cores((3,)) == "3"


def test_engine_flags_round_trip_through_the_engine_parser():
    import argparse

    args = EngineArgs(model="/m", max_model_len=1024, kv_cache_memory="256MiB",
                      enable_prefix_caching=False, max_num_seqs=8, block_size=32)
    p = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(p.parse_args(engine_flags(args))) == args


def test_plan_on_two_cores(monkeypatch):
    monkeypatch.setenv("PDSERVE_INSTANCE_ID", "would-collide")
    config = _config("--port", "18000", "--cpu-cores", "0-1", "--api-key", "sk-test",
                     "--max-model-len", "1024", "--kv-cache-memory", "256MiB",
                     "--no-enable-prefix-caching", "--max-num-seqs", "8", "--block-size", "32",
                     "--shutdown-timeout", "20")
    plan = build_plan(config, "/models/m", "m", python="python")
    names = [c.name for c in plan.children]
    assert names == ["redis", "prefill-0", "decode-0", "gateway"]
    ports = [p for c in plan.children for p in c.ports]
    assert len(ports) == len(set(ports)) == 6
    assert plan.gateway_url == "http://127.0.0.1:18000"
    # The core share: both engines may use both cores, and divide them step by step.
    assert [c.cores for c in plan.children] == [(), (0, 1), (0, 1), ()]
    assert all("sk-test" not in " ".join(c.argv) for c in plan.children)
    assert plan.children[-1].env == {"PDSERVE_API_KEY": "sk-test"}
    assert "PDSERVE_INSTANCE_ID" not in child_env({"PDSERVE_INSTANCE_ID": "x", "PATH": "/b"})

    parser = build_parser()
    prefill, decode = plan.children[1], plan.children[2]
    for spec, role in ((prefill, "prefill"), (decode, "decode")):
        assert spec.argv[:3] == ("python", "-m", "pdserve.services.cli")
        ns = parser.parse_args(list(spec.argv[3:]))
        assert (ns.command, ns.serve_role) == ("serve", role)
        assert ns.host == "127.0.0.1" and ns.redis_url == plan.redis_url
        assert (ns.port, ns.metrics_port) == spec.ports
        assert ns.grace_period == 15.0
        engine = EngineArgs.from_cli_args(ns)
        assert (engine.model, engine.served_model_name, engine.max_model_len,
                engine.kv_cache_memory, engine.enable_prefix_caching, engine.max_num_seqs,
                engine.block_size) == ("/models/m", "m", 1024, "256MiB", False, 8, 32)
        assert engine.cpu_cores == format_cores(spec.cores)
        assert engine.core_share == default_board_path()

    ns = parser.parse_args(list(plan.children[-1].argv[3:]))
    assert ns.local_prefill_threshold == 1_000_000_000  # one core share: unified
    assert ns.serve_role == "gateway"
    assert (ns.host, ns.port, ns.model, ns.served_model_name, ns.max_model_len) == \
        ("127.0.0.1", 18000, "/models/m", "m", 1024)
    assert ns.prefill_url == [prefill.probe.target] and ns.decode_url == [decode.probe.target]
    assert ns.redis_url == plan.redis_url and ns.block_size == 32


def _gateway_ns(*argv: str):
    plan = build_plan(_config(*argv), "/m", "m")
    return build_parser().parse_args(list(plan.children[-1].argv[3:]))


def test_shared_cores_or_latency_targets_prefill_on_the_decode_engine_unless_told_otherwise():
    # engines on one core share (the CPU default): unified
    assert _gateway_ns().local_prefill_threshold == 1_000_000_000
    # the prefill engines with cores of their own: conditional disaggregation by length
    for own_cores in (("--no-cpu-share",), ("--prefill-cpu-cores", "0"),
                      ("--decode-cpu-cores", "1"), ("--device", "cuda")):
        assert _gateway_ns(*own_cores).local_prefill_threshold == 256, own_cores
    for targets in (("--slo-ttft-ms", "2000"), ("--slo-tpot-ms", "100"),
                    ("--slo-ttft-ms", "2000", "--slo-tpot-ms", "100")):
        assert _gateway_ns("--no-cpu-share", *targets).local_prefill_threshold == \
            1_000_000_000
    # an explicit threshold wins; so does the load bound, passed through
    ns = _gateway_ns("--slo-tpot-ms", "100", "--local-prefill-threshold", "512",
                     "--max-prefill-queue-size", "2")
    assert (ns.local_prefill_threshold, ns.max_prefill_queue_size) == (512, 2)


def test_early_rejection_reaches_every_engine_and_needs_a_ttft_target(model_path):
    plan = build_plan(_config("--slo-ttft-ms", "2000", "--slo-early-reject"), "/m", "m")
    parser = build_parser()
    engines = [c for c in plan.children if c.name.startswith(("prefill", "decode"))]
    assert [c.name for c in engines] == ["prefill-0", "decode-0"]
    for spec in engines:
        engine = EngineArgs.from_cli_args(parser.parse_args(list(spec.argv[3:])))
        assert engine.slo_early_reject and engine.slo_ttft_ms == 2000, spec.name
    parallel = dataclasses.replace(engine, model=model_path).create_engine_configs()[3]
    assert parallel.slo_early_reject and parallel.slo_ttft_s == 2.0
    with pytest.raises(ValueError, match="--slo-early-reject needs a TTFT target"):
        EngineArgs(model=model_path, slo_early_reject=True).create_engine_configs()


def test_plan_without_core_share_splits_the_cores_statically():
    plan = build_plan(_config("--cpu-cores", "0-1", "--no-cpu-share"), "/m", "m")
    assert [c.cores for c in plan.children] == [(), (0,), (1,), ()]
    parser = build_parser()
    for spec in plan.children[1:3]:
        engine = EngineArgs.from_cli_args(parser.parse_args(list(spec.argv[3:])))
        assert engine.core_share == "" and engine.cpu_cores == format_cores(spec.cores)
    # A per-role override also means a static split.
    plan = build_plan(_config("--cpu-cores", "0-3", "--decode-cpu-cores", "3"), "/m", "m")
    assert [c.cores for c in plan.children] == [(), (0, 1, 2), (3,), ()]
    assert "--core-share" not in plan.children[1].argv


def test_plan_with_given_ports_replicas_and_external_redis():
    config = _config("--num-prefill", "2", "--num-decode", "3", "--prefill-port", "20000",
                     "--decode-port", "21000", "--prefill-metrics-port", "22000",
                     "--decode-metrics-port", "23000", "--redis-url", "redis://r:1/0",
                     "--no-cpu-share", "--no-cpu-split", "--host", "0.0.0.0")
    plan = build_plan(config, "/m", "m")
    assert [c.name for c in plan.children] == [
        "prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2", "gateway"]
    assert [c.ports for c in plan.children[:5]] == [
        (20000, 22000), (20001, 22001), (21000, 23000), (21001, 23001), (21002, 23002)]
    assert all("--cpu-cores" not in c.argv for c in plan.children)
    assert plan.redis_url == "redis://r:1/0" and plan.gateway_url == "http://127.0.0.1:8000"
    gateway = plan.children[-1].argv
    assert gateway[gateway.index("--decode-url") + 1] == \
        "127.0.0.1:21000,127.0.0.1:21001,127.0.0.1:21002"
    assert "--max-num-queued-requests" not in gateway  # the gateway's own default


def test_gateway_flags_pass_through():
    config = _config("--max-num-queued-requests", "4", "--max-queued-tokens", "9000",
                     "--max-request-retries", "0", "--local-prefill-threshold", "32")
    gateway = build_plan(config, "/m", "m").children[-1].argv
    for flag, value in [("--max-num-queued-requests", "4"), ("--max-queued-tokens", "9000"),
                        ("--max-request-retries", "0"), ("--local-prefill-threshold", "32")]:
        assert gateway[gateway.index(flag) + 1] == value
    # The gateway's own parser accepts the argv the launcher builds.
    import argparse

    from pdserve.services.gateway.config import add_cli_args

    ns = add_cli_args(argparse.ArgumentParser()).parse_args(
        list(gateway[gateway.index("serve") + 2:]))
    assert ns.max_num_queued_requests == 4 and ns.local_prefill_threshold == 32


@pytest.mark.parametrize("argv,flag", [(["--num-decode", "0"], "--num-decode"),
                                       (["--port", "70000"], "--port"),
                                       (["--shutdown-timeout", "0"], "--shutdown-timeout")])
def test_bad_flags_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        _config(*argv)


def test_up_parser_standalone():
    import argparse

    ns = add_up_args(argparse.ArgumentParser()).parse_args(["--model", "x"])
    assert ns.model == "x" and ns.port == 8000 and ns.host == "127.0.0.1"


def test_curl_line_pastes_as_is():
    line = curl_line("http://h:1", "it's-a-model", "k'ey")
    words = shlex.split(line)
    assert words[1] == "http://h:1/v1/chat/completions"
    # The key is never printed: the line takes it from the environment.
    assert "k'ey" not in line and "Authorization: Bearer $PDSERVE_API_KEY" in words
    body = json.loads(words[words.index("-d") + 1])
    assert body["model"] == "it's-a-model" and body["messages"][0]["role"] == "user"


def test_avoid_pinned_cores_of_other_engines():
    from pdserve.services.launcher.cores import PinnedEngine, _engine_role, avoid_pinned

    assert _engine_role(["python", "-m", "pdserve.services.cli", "--log-level", "INFO", "serve",
                         "decode", "--port", "1"]) == "decode"
    assert _engine_role(["/usr/bin/pdserve", "serve", "prefill"]) == "prefill"
    assert _engine_role(["python", "-m", "pdserve.services.prefill"]) == "prefill"
    assert _engine_role(["python", "-m", "pdserve.services.cli", "serve", "gateway"]) is None
    others = [PinnedEngine(11, "prefill", (0,)), PinnedEngine(12, "decode", (1,))]
    assert avoid_pinned((0, 1, 2, 3), []) == ((0, 1, 2, 3), None)
    free, reason = avoid_pinned((0, 1, 2, 3), others)
    assert free == (2, 3)
    assert reason == ("cores 0-1 are pinned by another pdserve's engines: pid 11 (prefill, "
                      "cores 0), pid 12 (decode, cores 1)")
    assert avoid_pinned((0, 1), others)[0] == ()


def test_generation_config_reaches_the_gateway():
    assert _gateway_ns().generation_config == "auto"
    assert _gateway_ns("--generation-config", "vllm").generation_config == "vllm"


def test_kv_events_endpoint_offset_per_engine():
    """One host, one port per engine: vLLM's per-rank offset, prefill-0.. then decode-0.."""
    from pdserve.services.common.kv_events import KVEventsConfig

    config = _config("--num-prefill", "2", "--num-decode", "2", "--kv-events-config",
                     '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
                     '"replay_endpoint": "tcp://*:5600", "topic": "kv"}')
    engines = [c for c in build_plan(config, "/m", "m").children
               if c.name.startswith(("prefill", "decode"))]
    parsed = []
    for spec in engines:
        ns = build_parser().parse_args(list(spec.argv[spec.argv.index("serve"):]))
        parsed.append(KVEventsConfig.from_value(ns.kv_events_config))
    assert [c.name for c in engines] == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    assert [(c.endpoint, c.replay_endpoint) for c in parsed] == [
        ("tcp://*:5557", "tcp://*:5600"), ("tcp://*:5558", "tcp://*:5601"),
        ("tcp://*:5559", "tcp://*:5602"), ("tcp://*:5560", "tcp://*:5603")]
    assert {(c.topic, c.publisher) for c in parsed} == {("kv", "zmq")}
    assert all("--kv-events-config" not in c.argv
               for c in build_plan(_config(), "/m", "m").children)
    with pytest.raises(ValueError, match="--kv-events-config: unknown key"):
        build_plan(_config("--kv-events-config", '{"endpont": "tcp://*:1"}'), "/m", "m")
