"""The internal surface: loopback by default, the shared token, explicit message limits.

Real prefill and decode services (real model, real gRPC) started with `internal_token`: every
PrefillService / DecodeService method refuses a call without the token (UNAUTHENTICATED),
grpc.health stays open, the decode's own FetchKV / ReleaseKV calls carry the token, and a
split request through the real gateway configured with the token works end to end.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import pytest_asyncio
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.services.common.config import ServiceConfig, add_service_args, config_from_args
from pdserve.services.gateway.config import add_cli_args as add_gateway_args
from pdserve.services.launcher.config import UpConfig
from pdserve.services.launcher.plan import build_plan
from pdserve.services.launcher.up import with_internal_token
from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto import engine_pb2_grpc
from pdserve.shared.config import DEFAULT_MAX_CHUNK_BYTES, MAX_GRPC_MESSAGE_BYTES
from pdserve.shared.engine_args import EngineArgs
from tests.services.gateway.conftest import running_gateway
from tests.services.helpers import (
    RPC_TIMEOUT,
    channel,
    engine_args,
    greedy,
    num_handle_blocks,
    service_config,
    start_runtime,
)

session_loop = pytest.mark.asyncio(loop_scope="session")
Code = grpc.StatusCode
TOKEN = "s3cret-internal-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
ROOT = Path(__file__).resolve().parents[2]


# -- flags, plans, compose (no engine) -------------------------------------------------------

def test_services_and_gateway_bind_loopback_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("PDSERVE_HOST", raising=False)
    assert ServiceConfig("decode").host == "127.0.0.1"
    for role in ("prefill", "decode"):
        ns = add_service_args(argparse.ArgumentParser(), role).parse_args([])
        assert config_from_args(ns, role).host == "127.0.0.1"
        ns = add_service_args(argparse.ArgumentParser(), role).parse_args(
            ["--host", "0.0.0.0", "--internal-token", TOKEN])
        assert config_from_args(ns, role).host == "0.0.0.0"
    assert add_gateway_args(argparse.ArgumentParser()).parse_args([]).host == "127.0.0.1"


def test_token_and_stall_flags_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", TOKEN)
    monkeypatch.setenv("PDSERVE_STALL_TIMEOUT", "2.5")
    ns = add_service_args(argparse.ArgumentParser(), "prefill").parse_args([])
    config = config_from_args(ns, "prefill")
    assert (config.internal_token, config.stall_timeout) == (TOKEN, 2.5)
    assert TOKEN not in repr(config), "the token must not reach the log line of the config"
    ns = add_service_args(argparse.ArgumentParser(), "decode").parse_args(
        ["--internal-token", ""])
    assert config_from_args(ns, "decode").internal_token is None
    for bad in (["--internal-token", "two words\n"], ["--stall-timeout", "-1"],
                ["--kv-chunk-bytes", str(MAX_GRPC_MESSAGE_BYTES)]):
        ns = add_service_args(argparse.ArgumentParser(), "prefill").parse_args(bad)
        with pytest.raises(ValueError, match=bad[0]):
            config_from_args(ns, "prefill")


def test_message_limit_is_sized_from_the_kv_chunk_cap():
    assert MAX_GRPC_MESSAGE_BYTES == DEFAULT_MAX_CHUNK_BYTES + (1 << 20)
    options = dict(ServiceConfig("prefill").grpc_options())
    assert options == {"grpc.max_send_message_length": MAX_GRPC_MESSAGE_BYTES,
                       "grpc.max_receive_message_length": MAX_GRPC_MESSAGE_BYTES}
    # The biggest KV chunk with its header fits.
    chunk = pb.KVChunk(request_id="r" * 128, block_indices=list(range(64)), dtype="float32",
                       shape=[30, 2, 5, 16, 3, 64], data=bytes(DEFAULT_MAX_CHUNK_BYTES))
    assert chunk.ByteSize() < MAX_GRPC_MESSAGE_BYTES


def test_pdserve_up_passes_the_token_to_every_service_by_environment():
    args = EngineArgs(kv_cache_memory="256MiB")
    plain = build_plan(UpConfig(engine_args=args, cpu_cores=(0, 1)), "/m", "m", python="py")
    assert all("PDSERVE_INTERNAL_TOKEN" not in c.env for c in plain.children)
    plan = build_plan(UpConfig(engine_args=args, cpu_cores=(0, 1), internal_token=TOKEN),
                      "/m", "m", python="py")
    served = [c for c in plan.children if c.name != "redis"]
    assert [c.name for c in served] == ["prefill-0", "decode-0", "gateway"]
    assert all(c.env.get("PDSERVE_INTERNAL_TOKEN") == TOKEN for c in served)
    assert all(TOKEN not in " ".join(c.argv) for c in plan.children)
    assert TOKEN not in repr(UpConfig(engine_args=args, internal_token=TOKEN))


def test_compose_binds_every_interface_and_forwards_the_token():
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    served = {name: s for name, s in services.items()
              if s.get("command", [None])[:2] == ["pdserve", "serve"]}
    assert set(served) == {"prefill", "decode", "prefill-gpu", "decode-gpu", "gateway"}
    for name, s in served.items():
        command = s["command"]
        assert command[command.index("--host") + 1] == "0.0.0.0", name
    text = (ROOT / "compose.yaml").read_text()
    # The engines' shared environment (a YAML anchor) and the gateway's: required (`:?`).
    required = "${PDSERVE_INTERNAL_TOKEN:?set PDSERVE_INTERNAL_TOKEN in .env}"
    assert text.count(f"PDSERVE_INTERNAL_TOKEN: {required}") == 2
    assert services["gateway"]["environment"]["PDSERVE_INTERNAL_TOKEN"] == required


def test_pdserve_up_makes_a_random_token_per_launch():
    config = UpConfig(engine_args=EngineArgs(kv_cache_memory="256MiB"), cpu_cores=(0, 1))
    first, second = with_internal_token(config), with_internal_token(config)
    assert first.internal_token and second.internal_token
    assert first.internal_token != second.internal_token and len(first.internal_token) >= 40
    given = dataclasses.replace(config, internal_token=TOKEN)
    assert with_internal_token(given).internal_token == TOKEN
    plan = build_plan(first, "/m", "m", python="py")
    assert {c.env.get("PDSERVE_INTERNAL_TOKEN") for c in plan.children
            if c.name != "redis"} == {first.internal_token}


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "prefill.internal"])
def test_an_engine_on_a_reachable_address_needs_a_token(monkeypatch, host):
    monkeypatch.delenv("PDSERVE_INTERNAL_TOKEN", raising=False)
    monkeypatch.delenv("PDSERVE_ALLOW_INSECURE_INTERNAL", raising=False)
    for role in ("prefill", "decode"):
        parse = add_service_args(argparse.ArgumentParser(), role).parse_args
        with pytest.raises(ValueError, match="--allow-insecure-internal"):
            config_from_args(parse(["--host", host]), role)
        assert config_from_args(parse(["--host", host, "--internal-token", TOKEN]), role)
        config = config_from_args(parse(["--host", host, "--allow-insecure-internal"]), role)
        assert config.allow_insecure_internal and config.internal_token is None
    for loopback in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        parse = add_service_args(argparse.ArgumentParser(), "decode").parse_args
        assert config_from_args(parse(["--host", loopback]), "decode").internal_token is None
    monkeypatch.setenv("PDSERVE_ALLOW_INSECURE_INTERNAL", "1")
    parse = add_service_args(argparse.ArgumentParser(), "prefill").parse_args
    assert config_from_args(parse(["--host", host]), "prefill").allow_insecure_internal


# -- real services with a token --------------------------------------------------------------

@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def secured(model_path):
    prefill = await start_runtime(service_config("prefill", None, internal_token=TOKEN),
                                  engine_args(model_path))
    decode = await start_runtime(service_config("decode", None, internal_token=TOKEN),
                                 engine_args(model_path))
    channels = [channel(prefill.identity.address), channel(decode.identity.address)]
    try:
        await asyncio.gather(prefill.wait_ready(300), decode.wait_ready(300))
        yield SimpleNamespace(
            prefill=prefill, decode=decode,
            prefill_stub=engine_pb2_grpc.PrefillServiceStub(channels[0]),
            decode_stub=engine_pb2_grpc.DecodeServiceStub(channels[1]),
            health=[health_pb2_grpc.HealthStub(c) for c in channels],
            channels=dict(zip(("PrefillService", "DecodeService"), channels, strict=True)))
    finally:
        for c in channels:
            await c.close()
        await asyncio.wait_for(asyncio.gather(prefill.stop(0.5), decode.stop(0.5)), 60)


def _calls(s, metadata) -> dict[str, object]:
    """One call of every PrefillService and DecodeService method (awaitables)."""
    kw = {"timeout": RPC_TIMEOUT, "metadata": metadata}
    p, d = s.prefill_stub, s.decode_stub
    calls = {
        "PrefillService.Prefill": p.Prefill(pb.PrefillRequest(
            request_id="a", prompt_token_ids=[1, 2, 3], sampling_params=greedy(2)), **kw),
        "PrefillService.FetchKV": _collect(p.FetchKV(pb.FetchKVRequest(request_id="a"), **kw)),
        "PrefillService.ReleaseKV": p.ReleaseKV(pb.ReleaseKVRequest(request_id="a"), **kw),
        "PrefillService.Abort": p.Abort(pb.AbortRequest(request_ids=["a"]), **kw),
        "PrefillService.GetState": p.GetState(pb.GetStateRequest(), **kw),
        "DecodeService.Generate": _collect(d.Generate(pb.DecodeRequest(
            request_id="a", prompt_token_ids=[1, 2, 3], sampling_params=greedy(2)), **kw)),
        "DecodeService.Abort": d.Abort(pb.AbortRequest(request_ids=["a"]), **kw),
        "DecodeService.GetState": d.GetState(pb.GetStateRequest(), **kw),
    }
    # Any other method the proto declares: called with its default request message.
    for svc, ch in s.channels.items():
        for m in pb.DESCRIPTOR.services_by_name[svc].methods:
            if f"{svc}.{m.name}" not in calls:
                calls[f"{svc}.{m.name}"] = _default_call(ch, m, kw)
    return calls


def _default_call(ch: grpc.aio.Channel, method, kw: dict):
    """Call `method` (a MethodDescriptor) with an empty request, unary or server-streamed."""
    request, response = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
    path = f"/{method.containing_service.full_name}/{method.name}"
    codec = {"request_serializer": request.SerializeToString,
             "response_deserializer": response.FromString}
    if method.server_streaming:
        return _collect(ch.unary_stream(path, **codec)(request(), **kw))
    return ch.unary_unary(path, **codec)(request(), **kw)


@session_loop
@pytest.mark.parametrize("metadata", [
    (), (("authorization", "Bearer wrong-token"),), (("authorization", TOKEN),),
    (("authorization", f"Bearer {TOKEN}x"),), (("x-internal-token", TOKEN),)],
    ids=["none", "wrong", "no-bearer", "longer", "other-key"])
async def test_every_method_refuses_a_call_without_the_token(secured, metadata):
    calls = _calls(secured, metadata)
    # Every method of both services, as the proto declares them.
    declared = {f"{svc}.{m.name}" for svc in ("PrefillService", "DecodeService")
                for m in pb.DESCRIPTOR.services_by_name[svc].methods}
    assert set(calls) == declared, declared ^ set(calls)
    for name, call in calls.items():
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == Code.UNAUTHENTICATED, (name, info.value)
        assert "internal token" in info.value.details(), name
    # Liveness / readiness probes need no token.
    for stub in secured.health:
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=RPC_TIMEOUT)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    # Nothing ran: no request was ever admitted.
    for stub in (secured.prefill_stub, secured.decode_stub):
        state = await stub.GetState(pb.GetStateRequest(check_invariants=True),
                                    timeout=RPC_TIMEOUT, metadata=AUTH)
        assert state.num_used_blocks == 0 and state.num_pinned_blocks == 0
        assert state.num_running == 0 and state.num_waiting == 0 and state.invariants_ok


@session_loop
async def test_a_split_request_with_the_token_works(secured):
    prompt = list(range(1000, 1050))  # 3 full blocks travel by FetchKV
    before = secured.decode.worker.metrics.value("kv_transfer_blocks_received_total")
    resp = await secured.prefill_stub.Prefill(pb.PrefillRequest(
        request_id="ok", prompt_token_ids=prompt, sampling_params=greedy(6)),
        timeout=RPC_TIMEOUT, metadata=AUTH)
    chunks = await _collect(secured.decode_stub.Generate(pb.DecodeRequest(
        request_id="ok", prompt_token_ids=prompt, output_token_ids=[resp.first_token_id],
        sampling_params=greedy(6), kv_transfer_params=resp.kv_transfer_params),
        timeout=RPC_TIMEOUT, metadata=AUTH))
    tokens = [resp.first_token_id] + [t for c in chunks for t in c.token_ids]
    assert len(tokens) == 6 and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    received = secured.decode.worker.metrics.value("kv_transfer_blocks_received_total") - before
    assert received == num_handle_blocks(resp.kv_transfer_params) == 4
    # The decode's ReleaseKV (background, with the token) unpins the prefill's blocks.
    state = await _wait_unpinned(secured.prefill_stub)
    assert state.num_pinned_blocks == 0 and state.num_used_blocks == 0


@session_loop
async def test_a_decode_without_the_token_cannot_fetch_kv(secured, cluster):
    """The session cluster's decode has no token: its FetchKV to the secured prefill is
    refused, the status comes back through Generate, and its blocks are freed."""
    prompt = list(range(2000, 2040))
    resp = await secured.prefill_stub.Prefill(pb.PrefillRequest(
        request_id="stranger", prompt_token_ids=prompt, sampling_params=greedy(4)),
        timeout=RPC_TIMEOUT, metadata=AUTH)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(cluster.decode_stub.Generate(pb.DecodeRequest(
            request_id="stranger", prompt_token_ids=prompt,
            output_token_ids=[resp.first_token_id], sampling_params=greedy(4),
            kv_transfer_params=resp.kv_transfer_params), timeout=RPC_TIMEOUT))
    assert info.value.code() == Code.ABORTED and "FetchKV" in info.value.details()
    assert "UNAUTHENTICATED" in info.value.details()
    state = await cluster.decode_stub.GetState(pb.GetStateRequest(check_invariants=True),
                                               timeout=RPC_TIMEOUT)
    assert state.num_used_blocks == 0 and state.invariants_ok
    released = await secured.prefill_stub.ReleaseKV(pb.ReleaseKVRequest(request_id="stranger"),
                                                    timeout=RPC_TIMEOUT, metadata=AUTH)
    assert released.released, "the stranger's ReleaseKV must not have been obeyed"


@session_loop
async def test_a_message_over_the_limit_is_refused(secured):
    big = pb.PrefillRequest(request_id="big", sampling_params=greedy(2),
                            prompt_token_ids=[40000] * (MAX_GRPC_MESSAGE_BYTES // 3 + 1))
    assert big.ByteSize() > MAX_GRPC_MESSAGE_BYTES
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await secured.prefill_stub.Prefill(big, timeout=RPC_TIMEOUT, metadata=AUTH)
    assert info.value.code() == Code.RESOURCE_EXHAUSTED


@session_loop
async def test_the_gateway_with_the_token_serves_a_split_request(secured, model_path):
    urls = SimpleNamespace(prefill_urls=(secured.prefill.identity.address,),
                           decode_urls=(secured.decode.identity.address,))
    before = secured.decode.worker.metrics.value("kv_transfer_blocks_received_total")
    messages = [{"role": "user", "content": "Name three colors of the rainbow, please."}]
    async with running_gateway(model_path, urls, internal_token=TOKEN) as gw:
        resp = await gw.http.post("/v1/chat/completions", json={
            "model": gw.config.served_model_name, "messages": messages, "max_tokens": 8,
            "temperature": 0})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["message"]["content"]
        assert (await gw.http.get("/health")).status_code == 200
    assert secured.decode.worker.metrics.value("kv_transfer_blocks_received_total") > before
    async with running_gateway(model_path, urls) as gw:  # no token: refused, as an error
        resp = await gw.http.post("/v1/chat/completions", json={
            "model": gw.config.served_model_name, "messages": messages, "max_tokens": 8})
        assert resp.status_code >= 500 and "error" in resp.json(), resp.text
    await _wait_unpinned(secured.prefill_stub)


async def _wait_unpinned(stub, timeout: float = 20.0) -> pb.EngineState:
    deadline = time.monotonic() + timeout
    while True:
        state = await stub.GetState(pb.GetStateRequest(), timeout=RPC_TIMEOUT, metadata=AUTH)
        if state.num_pinned_blocks == 0 and state.num_used_blocks == 0 \
                or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.05)


async def _collect(call) -> list:
    return [item async for item in call]
