"""Multi-LoRA serving over the split, through real prefill and decode services, Redis and the
gateway (issue 31, the services half): `model` picks the adapter, /v1/models lists them,
vLLM's admin routes load and unload them on every instance, a decode refuses KV of another
adapter, and a load / unload storm during traffic serves nobody with the wrong adapter and
leaks no block.

The references are transformers + PEFT fp32 greedy tokens of adapters made here with random
non-zero A and B (tests/shared/lora/adapters.py), computed before the services start.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import httpx
import openai
import pytest
import pytest_asyncio

from pdserve.services.common.lora_modules import adapter_to_proto, make_lora_request
from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto.engine_pb2_grpc import DecodeServiceStub, PrefillServiceStub
from tests.services.gateway.conftest import running_gateway
from tests.services.helpers import (
    RPC_TIMEOUT,
    Cluster,
    channel,
    engine_args,
    greedy,
    service_config,
    start_runtime,
    wait_leak_free,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.fp32_only]

SERVED = "lora-split-test"
"""The cluster's served model name (its own registry key in the session's Redis)."""
ADMIN, TENANT = "admin-key", "tenant-key"
MAX_TOKENS = 8
PROMPTS = ["The capital of France is", "Once upon a time, a small robot",
           "List three colors:"]
ADAPTERS = {"alpha": dict(rank=8, targets=["q_proj", "v_proj"], seed=1),
            "beta": dict(rank=16, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                           "up_proj", "down_proj"], seed=2),
            "gamma": dict(rank=8, targets=["o_proj", "down_proj"], seed=3)}
"""alpha and beta load at start-up (--lora-modules); gamma through the admin route."""


@dataclasses.dataclass
class Setup:
    paths: dict[str, str]
    prompt_ids: list[list[int]]
    reference: dict[str | None, list[list[int]]]
    """adapter name (None: the base model) -> greedy tokens per prompt."""
    cluster: Cluster
    gateway: object


@pytest.fixture(scope="module")
def adapters(model_path, tmp_path_factory, tokenizer):
    """The PEFT adapters and every model's reference tokens (computed before the cluster)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.shared.lora.adapters import make_adapter, peft_greedy

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("lora")
    paths = {name: str(make_adapter(root / name, base, spec["rank"], spec["targets"],
                                    spec["seed"], std=0.05))
             for name, spec in ADAPTERS.items()}
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    reference = {None: peft_greedy(base, None, prompt_ids, MAX_TOKENS)}
    for name, path in paths.items():
        reference[name] = peft_greedy(base, path, prompt_ids, MAX_TOKENS)
    del base
    return paths, prompt_ids, reference


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def setup(model_path, adapters, redis_server):
    if redis_server is None:
        pytest.skip("redis-server is not installed (the registry lists the adapters)")
    paths, prompt_ids, reference = adapters
    modules = tuple(make_lora_request(n, paths[n]) for n in ("alpha", "beta"))
    args = engine_args(model_path, served_model_name=SERVED, enable_lora=True, max_loras=2,
                       max_lora_rank=16, max_cpu_loras=4, max_num_seqs=16)
    runtimes = [await start_runtime(service_config(role, redis_server.url,
                                                   lora_modules=modules), args)
                for role in ("prefill", "decode")]
    await asyncio.gather(*(r.wait_ready(300) for r in runtimes))
    cluster = Cluster(runtimes[0], runtimes[1], None)
    urls = dataclasses.make_dataclass("Urls", ["prefill_urls", "decode_urls"])(
        (runtimes[0].identity.address,), (runtimes[1].identity.address,))
    async with running_gateway(model_path, urls, served_model_name=SERVED,
                               redis_url=redis_server.url, api_key=TENANT,
                               admin_api_key=ADMIN, rpc_timeout=10.0) as gw:
        gw.client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TENANT, max_retries=0,
                                       timeout=120)
        try:
            yield Setup(paths, prompt_ids, reference, cluster, gw)
        finally:
            await gw.client.close()
            await cluster.close()


async def complete(setup: Setup, model: str, i: int) -> list[int]:
    """The greedy tokens of prompt i under `model`, through the gateway."""
    out = await setup.gateway.client.completions.create(
        model=model, prompt=setup.prompt_ids[i], max_tokens=MAX_TOKENS, temperature=0.0,
        logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


def admin(setup: Setup, key: str | None = ADMIN) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(base_url=setup.gateway.url, headers=headers, timeout=120)


async def test_model_picks_the_adapter(setup):
    for model in (SERVED, "alpha", "beta"):
        got = [await complete(setup, model, i) for i in range(len(PROMPTS))]
        assert got == setup.reference[None if model == SERVED else model], model
    assert setup.reference["alpha"] != setup.reference[None]  # a non-trivial adapter
    assert setup.reference["beta"] != setup.reference[None]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await complete(setup, "no-such-adapter", 0)


async def test_models_lists_adapters_with_parent(setup):
    models = {m.id: m for m in (await setup.gateway.client.models.list()).data}
    assert models[SERVED].parent is None
    for name in ("alpha", "beta"):
        assert models[name].parent == SERVED
        assert models[name].root == setup.paths[name]
    assert (await setup.gateway.client.models.retrieve("alpha")).parent == SERVED


async def test_admin_routes_need_the_admin_key(setup):
    body = {"lora_name": "gamma", "lora_path": setup.paths["gamma"]}
    for key, status in ((None, 401), (TENANT, 403)):
        async with admin(setup, key) as http:
            assert (await http.post("/v1/load_lora_adapter", json=body)).status_code == status
            assert (await http.post("/v1/unload_lora_adapter",
                                    json={"lora_name": "alpha"})).status_code == status


async def test_load_serve_unload_through_the_admin_routes(setup, tmp_path):
    async with admin(setup) as http:
        r = await http.post("/v1/load_lora_adapter",
                            json={"lora_name": "gamma", "lora_path": setup.paths["gamma"]})
        assert r.status_code == 200, r.text
        assert "gamma" in {m.id for m in (await setup.gateway.client.models.list()).data}
        assert await complete(setup, "gamma", 0) == setup.reference["gamma"][0]
        await _another_gateway_serves_gamma(setup)
        again = await http.post("/v1/load_lora_adapter", json={
            "lora_name": "gamma", "lora_path": setup.paths["gamma"]})
        assert again.status_code == 400 and "already been loaded" in again.text
        # A bad adapter: refused by every instance, named; nothing loaded is harmed.
        bad = await http.post("/v1/load_lora_adapter",
                              json={"lora_name": "bad", "lora_path": str(tmp_path)})
        assert bad.status_code == 400, bad.text
        for runtime in setup.cluster.runtimes:
            assert runtime.identity.address in bad.json()["error"]["message"]
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"})
        assert r.status_code == 200, r.text
        with pytest.raises(openai.NotFoundError):
            await complete(setup, "gamma", 0)
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"})
        assert r.status_code == 404
    for runtime in setup.cluster.runtimes:
        assert set(runtime.worker.lora.adapters) == {"alpha", "beta"}
    assert await complete(setup, "alpha", 1) == setup.reference["alpha"][1]


async def _another_gateway_serves_gamma(setup: Setup) -> None:
    """A gateway that knows the instances from Redis only lists and serves the adapter the
    first one loaded (the instances registered it)."""
    empty = dataclasses.make_dataclass("Urls", ["prefill_urls", "decode_urls"])((), ())
    async with running_gateway(setup.gateway.config.model_path, empty, served_model_name=SERVED,
                               redis_url=setup.gateway.config.redis_url) as gw2:
        client = gw2.client.with_options(timeout=120)
        for _ in range(100):
            if "gamma" in {m.id for m in (await client.models.list()).data}:
                break
            await asyncio.sleep(0.1)
        out = await client.completions.create(
            model="gamma", prompt=setup.prompt_ids[0], max_tokens=MAX_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True})
        assert out.choices[0].text == setup.gateway.app.state.gateway.tokenizer.decode(
            setup.reference["gamma"][0])


async def test_decode_refuses_kv_of_another_adapter(setup):
    c = setup.cluster
    prompt = setup.prompt_ids[1]
    alpha, beta = (adapter_to_proto(c.prefill.worker.lora.adapters[n]) for n in
                   ("alpha", "beta"))
    async with channel(c.prefill.identity.address) as p, \
            channel(c.decode.identity.address) as d:
        prefill, decode = PrefillServiceStub(p), DecodeServiceStub(d)
        for rid, under, decode_under in (("kv-alpha-beta", alpha, beta),
                                         ("kv-alpha-base", alpha, None)):
            resp = await prefill.Prefill(pb.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling_params=greedy(4),
                lora_request=under), timeout=RPC_TIMEOUT)
            assert resp.kv_transfer_params.lora_name == "alpha"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in decode.Generate(pb.DecodeRequest(
                        request_id=rid, prompt_token_ids=prompt,
                        output_token_ids=[resp.first_token_id], sampling_params=greedy(4),
                        kv_transfer_params=resp.kv_transfer_params,
                        lora_request=decode_under), timeout=RPC_TIMEOUT):
                    pass
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "'alpha'" in e.value.details()
            assert ("'beta'" if decode_under else "base model") in e.value.details()
            await prefill.Abort(pb.AbortRequest(request_ids=[rid]), timeout=RPC_TIMEOUT)
    await _assert_leak_free(c)


async def test_load_unload_storm_during_traffic(setup):
    """16 streams over alpha, beta and the base model while alpha is unloaded and loaded
    again: each answer is complete and its adapter's, or an OpenAI error; no block leaks."""
    models = ["alpha", "beta", SERVED, "alpha"] * 4

    async def one(k: int) -> tuple[str, int, list[int] | Exception]:
        model, i = models[k], k % len(PROMPTS)
        await asyncio.sleep(0.05 * k)
        try:
            return model, i, await complete(setup, model, i)
        except openai.APIError as e:
            return model, i, e

    async def storm() -> None:
        async with admin(setup) as http:
            await asyncio.sleep(0.3)
            r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "alpha"})
            assert r.status_code == 200, r.text
            r = await http.post("/v1/load_lora_adapter",
                                json={"lora_name": "alpha", "lora_path": setup.paths["alpha"]})
            assert r.status_code == 200, r.text

    results, _ = await asyncio.gather(asyncio.gather(*(one(k) for k in range(len(models)))),
                                      storm())
    served = 0
    for model, i, got in results:
        if isinstance(got, Exception):
            assert model == "alpha", (model, got)  # only the adapter that went away
            continue
        served += 1
        assert got == setup.reference[None if model == SERVED else model][i], (model, i)
    assert served >= len(models) // 2
    await _assert_leak_free(setup.cluster)
    assert await complete(setup, "alpha", 2) == setup.reference["alpha"][2]


async def _assert_leak_free(cluster: Cluster) -> None:
    prefill, decode = await wait_leak_free(cluster)
    for state in (prefill, decode):
        assert state.invariants_ok, state.invariants_error
        assert state.num_used_blocks == 0 and state.num_pinned_blocks == 0


async def test_a_bad_start_up_adapter_fails_the_start_in_one_line(model_path, adapters):
    """--lora-modules with an adapter the engine refuses (rank 16 over --max-lora-rank 8):
    the instance never serves, and says why in one line (`serve` exits 2 with it)."""
    paths = adapters[0]
    runtime = await start_runtime(
        service_config("prefill", None, lora_modules=(make_lora_request("beta", paths["beta"]),)),
        engine_args(model_path, enable_lora=True, max_lora_rank=8))
    try:
        with pytest.raises(RuntimeError, match="beta"):
            await runtime.wait_ready(300)
        assert runtime.startup_error is not None and "\n" not in runtime.startup_error
        assert "rank" in runtime.startup_error
    finally:
        await runtime.stop(0)


async def test_lora_requests_info_gauge(setup):
    from prometheus_client.parser import text_string_to_metric_families

    for runtime in setup.cluster.runtimes:
        await runtime.monitor.tick()
        families = {f.name: f for f in text_string_to_metric_families(
            runtime.worker.metrics.render().decode())}
        (sample,) = families["pdserve_lora_requests_info"].samples
        assert sample.labels["max_lora"] == "2"
        assert {"running_lora_adapters", "waiting_lora_adapters"} <= set(sample.labels)
