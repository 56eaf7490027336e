"""N prefill x M decode hosts (issue 15's acceptance), as separate "hosts" on one machine:
Linux network namespaces on a private bridge this test creates and removes (10.77.k.0/24),
each host with its own address, hostname, HOME and copy of the model (nothing shared
through the filesystem but the code), running real processes: Redis, 2 prefill, 2 decode
and 2 gateways, then a third decode that joins. Instances bind 0.0.0.0 and derive the
address they advertise (their route to Redis); the gateways get no instance list, only
--redis-url. Skipped where namespaces cannot be made (not root).

The tests run in file order on one cluster (short heartbeats: HEARTBEAT_S / TTL_S):
1. chat through both gateways: token-identical to the in-process engine (shared.llm.LLM);
2. a repeated long prefix goes to the prefill and decode hosts that hold it (their own
   counters: prefix-cache hits, prompt tokens, KV blocks received);
3. a third decode host started mid-run gets requests within 10 s of turning SERVING;
4. a decode host's link cut mid-stream: every stream completes (failover; identically in
   fp32, see _assert_answers), and the host's registration is gone from Redis within one
   TTL; the link restored, it rejoins;
5. a decode host drained by SIGTERM mid-stream: its streams finish there (identically in
   fp32), no client error, no failover, exit 0;
6. afterwards no KV block is in use or pinned anywhere (every pool's invariants hold), and a
   prefill host told to stop leaves Redis at once.
The fixture's finalizer kills every process and removes the namespaces and the bridge, also
when a test failed, and fails the run if any is left.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
import pytest_asyncio
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve.services.proto import engine_pb2, engine_pb2_grpc
from tests.conftest import PARITY_MESSAGES, TEST_QUANTIZATION
from tests.e2e.netns_hosts import Host, HostNetwork, HostProcess, cannot_make_hosts
from tests.procs import REPO_ROOT

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
TOKEN = "multihost-internal-token-0123456789"
HEARTBEAT_S, TTL_S = 0.5, 3.0
KEEPALIVE_S = 1.0
"""PDSERVE_GRPC_KEEPALIVE_S of every process: a cut host's calls fail within ~3 s."""
GRACE_S = 30
PORTS = {"prefill": (50051, 9051), "decode": (50052, 9052)}
GATEWAY_PORT = 8000
ENGINE_FLAGS = ["--kv-cache-memory", "128MiB", "--max-model-len", "2048", "--num-threads", "1",
                "--heartbeat-interval", str(HEARTBEAT_S), "--registration-ttl", str(TTL_S),
                "--grace-period", str(GRACE_S)]
PARITY = PARITY_MESSAGES[:4]
PARITY_MAX_TOKENS = 12
CUT_STREAMS = PARITY_MESSAGES[4:8]
DRAIN_STREAMS = PARITY_MESSAGES[:4]
STREAM_MAX_TOKENS = 48
DRAIN_MAX_TOKENS = 160
"""The drained host's streams are longer: with 48 tokens they could all finish (about 30 ms a
token for 4 streams) before the test reads which decode runs them (a CI failure)."""
JOIN_BOUND_S = 10.0
NUMBERS: dict[str, object] = {}
"""What the run measured, printed at the end (for the closing note)."""


@dataclass(frozen=True)
class Reference:
    text: str
    num_tokens: int
    finish_reason: str | None


@dataclass
class Engine:
    role: str
    host: Host
    process: HostProcess | None = None

    @property
    def address(self) -> str:
        return f"{self.host.address}:{PORTS[self.role][0]}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host.address}:{PORTS[self.role][1]}/metrics"

    def start(self, redis_url: str) -> None:
        port, metrics_port = PORTS[self.role]
        self.process = self.host.start(
            [sys.executable, "-m", "pdserve.services.cli", "serve", self.role, "--model", MODEL,
             "--host", "0.0.0.0", "--port", str(port), "--metrics-port", str(metrics_port),
             "--redis-url", redis_url, *ENGINE_FLAGS], env=_env())


@dataclass
class Gateway:
    host: Host
    process: HostProcess | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host.address}:{GATEWAY_PORT}"


@dataclass
class Cluster:
    net: HostNetwork
    redis_url: str
    redis: redis.Redis
    prefills: list[Engine]
    decodes: list[Engine]
    joiner: Engine
    """The decode host that joins mid-run (test 3)."""
    gateways: list[Gateway]
    http: httpx.AsyncClient = field(init=False)

    @property
    def engines(self) -> list[Engine]:
        return [*self.prefills, *self.decodes]

    def live_decodes(self) -> list[Engine]:
        return [d for d in self.decodes if d.process is not None and d.process.alive]

    def registered(self) -> dict[str, str]:
        """address -> instance_id of every live registration (Redis's own view)."""
        out = {}
        for iid in self.redis.smembers(f"pdserve:instances:{MODEL}"):
            info = self.redis.get(f"pdserve:instance:{iid.decode()}")
            if info is not None:
                out[json.loads(info)["address"]] = iid.decode()
        return out


def _env() -> dict[str, str]:
    return {"PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "PDSERVE_INTERNAL_TOKEN": TOKEN, "PDSERVE_GRPC_KEEPALIVE_S": str(KEEPALIVE_S),
            "PDSERVE_QUANTIZATION": TEST_QUANTIZATION}


def _copy_model(model_path: str, target: Path, weights: bool = True) -> None:
    """A real copy (no hardlink): the host's own model cache."""
    target.mkdir(parents=True)
    for f in Path(model_path).iterdir():
        if f.is_file() and (weights or f.suffix != ".safetensors"):
            shutil.copyfile(f, target / f.name)


def _health(address: str, timeout: float = 1.0) -> int | None:
    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout).status
        except grpc.RpcError:
            return None


def _wait_serving(engines: list[Engine], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(engines)
    while pending:
        for e in list(pending):
            assert e.process is not None and e.process.alive, \
                f"{e.host.name} exited:\n{e.process.log_tail() if e.process else ''}"
            if _health(e.address) == health_pb2.HealthCheckResponse.SERVING:
                pending.remove(e)
        assert time.monotonic() < deadline or not pending, \
            f"{pending[0].host.name} never became SERVING:\n{pending[0].process.log_tail()}"
        time.sleep(0.2)


def _wait_gateway(gw: Gateway, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(trust_env=False, timeout=5) as client:
        while True:
            assert gw.process is not None and gw.process.alive, gw.process.log_tail()
            try:
                if client.get(f"{gw.url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{gw.host.name}:\n{gw.process.log_tail()}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def hosts_possible() -> None:
    reason = cannot_make_hosts()
    if reason:
        pytest.skip(f"multi-host test: {reason}")
    if shutil.which("redis-server") is None:
        pytest.skip("multi-host test: redis-server is not installed")


@pytest.fixture(scope="module")
def reference(hosts_possible, model_path) -> dict[str, list[Reference]]:
    """The in-process engine's greedy answers (built and freed before the hosts start)."""
    import torch

    from pdserve.shared.llm import LLM
    from pdserve.shared.sampling_params import SamplingParams

    started, threads = time.monotonic(), torch.get_num_threads()
    # NOTE: one thread: two OpenMP threads on a busy 2-core machine took 10x as long here.
    llm = LLM(model_path, kv_cache_memory="128MiB", max_model_len=2048, num_threads=1)
    out = {}
    for name, messages, max_tokens in (("parity", PARITY, PARITY_MAX_TOKENS),
                                       ("cut", CUT_STREAMS, STREAM_MAX_TOKENS),
                                       ("drain", DRAIN_STREAMS, DRAIN_MAX_TOKENS)):
        outs = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        out[name] = [Reference(o.outputs[0].text, len(o.outputs[0].token_ids),
                               o.outputs[0].finish_reason) for o in outs]
    del llm
    torch.set_num_threads(threads)  # the engine set it process-wide
    NUMBERS["reference_s"] = round(time.monotonic() - started, 1)
    return out


@pytest.fixture(scope="module")
def cluster(model_path, reference, tmp_path_factory) -> Iterator[Cluster]:
    started = time.monotonic()
    net = HostNetwork.create(tmp_path_factory.mktemp("hosts"))
    try:
        redis_host = net.add_host("redis", 2)
        prefills = [Engine("prefill", net.add_host(f"p{n}", 11 + i)) for i, n in enumerate("ab")]
        decodes = [Engine("decode", net.add_host(f"d{n}", 21 + i)) for i, n in enumerate("ab")]
        joiner = Engine("decode", net.add_host("dc", 23))
        gateways = [Gateway(net.add_host(f"g{n}", 31 + i)) for i, n in enumerate("ab")]
        for e in (*prefills, *decodes, joiner):
            _copy_model(model_path, e.host.home / ".cache" / "pdserve" / "models" / MODEL)
        for g in gateways:  # the tokenizer and chat template only
            _copy_model(model_path, g.host.home / "model" / MODEL, weights=False)
        NUMBERS["hosts_ready_s"] = round(time.monotonic() - started, 1)

        redis_host.start(["redis-server", "--bind", "0.0.0.0", "--port", "6379", "--save", "",
                          "--appendonly", "no", "--protected-mode", "no",
                          "--dir", str(redis_host.home)])
        redis_url = f"redis://{redis_host.address}:6379/0"
        for e in (*prefills, *decodes):
            e.start(redis_url)
        for g in gateways:
            g.process = g.host.start(
                [sys.executable, "-m", "pdserve.services.cli", "serve", "gateway",
                 "--model", str(g.host.home / "model" / MODEL), "--host", "0.0.0.0",
                 "--port", str(GATEWAY_PORT), "--redis-url", redis_url,
                 "--health-check-interval", "0.5", "--rpc-timeout", "10",
                 "--grace-period", "20"], env=_env())
        client = redis.Redis(host=redis_host.address, port=6379, socket_timeout=5)
        c = Cluster(net, redis_url, client, prefills, decodes, joiner, gateways)
        _wait_serving(c.engines, 300)
        for g in gateways:
            _wait_gateway(g, 120)
        NUMBERS["cluster_ready_s"] = round(time.monotonic() - started, 1)
        yield c
        client.close()
    finally:
        leftovers = net.close()
        NUMBERS["total_s"] = round(time.monotonic() - started, 1)
        print("\nmulti-host numbers:", json.dumps(NUMBERS))
    assert not leftovers, f"namespaces or links left behind: {leftovers}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def c(cluster) -> Cluster:
    cluster.http = httpx.AsyncClient(trust_env=False, timeout=180)
    yield cluster
    await cluster.http.aclose()


# -- helpers ----------------------------------------------------------------------------------

async def _chat(c: Cluster, gw: Gateway, messages, max_tokens: int) -> Reference:
    r = await c.http.post(f"{gw.url}/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    return Reference(choice["message"]["content"], body["usage"]["completion_tokens"],
                     choice["finish_reason"])


@dataclass
class Stream:
    texts: list[str] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    num_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False

    def result(self) -> Reference:
        return Reference("".join(self.texts), self.num_tokens or 0, self.finish_reason)


async def _stream(c: Cluster, gw: Gateway, messages, out: Stream,
                  max_tokens: int = STREAM_MAX_TOKENS) -> None:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    async with c.http.stream("POST", f"{gw.url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.errors.append(event["error"])
                continue
            if event.get("usage"):
                out.num_tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                if choice["delta"].get("content"):
                    out.texts.append(choice["delta"]["content"])
                out.finish_reason = choice["finish_reason"] or out.finish_reason


async def _metrics(c: Cluster, url: str) -> dict[str, float]:
    """Every sample of `url`'s /metrics, label sets summed per sample name (+ kind labels)."""
    text = (await c.http.get(url, timeout=10)).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + (f"{{{s.labels['kind']}}}" if "kind" in s.labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


async def _scrape(c: Cluster, engines: list[Engine]) -> list[dict[str, float]]:
    return list(await asyncio.gather(*(_metrics(c, e.metrics_url) for e in engines)))


async def _decode_failovers(c: Cluster) -> float:
    values = await asyncio.gather(*(_metrics(c, f"{g.url}/metrics") for g in c.gateways))
    return sum(v.get("pdserve_gateway_failovers_total{decode}", 0.0) for v in values)


async def _until(predicate, what: str, timeout: float, interval: float = 0.05) -> float:
    """Seconds until `predicate()` (sync or async) holds."""
    started = time.monotonic()
    while True:
        got = predicate()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return time.monotonic() - started
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        await asyncio.sleep(interval)


async def _start_streams(c: Cluster, messages_list, min_chunks: int,
                         max_tokens: int = STREAM_MAX_TOKENS):
    """One stream per message, alternating gateways; returns once each has `min_chunks`."""
    streams = [Stream() for _ in messages_list]
    tasks = [asyncio.ensure_future(_stream(c, c.gateways[i % 2], m, s, max_tokens))
             for i, (m, s) in enumerate(zip(messages_list, streams))]
    await _until(lambda: all(len(s.texts) >= min_chunks or s.done for s in streams)
                 or any(t.done() and t.exception() for t in tasks),
                 "every stream to start", 120)
    return streams, tasks


async def _busiest_decode(c: Cluster, streams: list[Stream]) -> tuple[Engine, int]:
    """The decode running most of `streams`, by its gauges. These are sampled every
    publish_interval (0.25 s), and a stream a few chunks in can be younger than the last
    sample (every decode read 0 in a CI run), so read until one shows a running request."""
    found: list[tuple[Engine, int]] = []

    async def one_runs() -> bool:
        decodes = c.live_decodes()
        running = [int(m.get("pdserve_num_requests_running", 0))
                   for m in await _scrape(c, decodes)]
        i = max(range(len(decodes)), key=running.__getitem__)
        found[:] = [(decodes[i], running[i])]
        return running[i] >= 1 or all(s.done for s in streams)

    await _until(one_runs, "a decode to report a running stream", 10, 0.1)
    return found[0]


def _assert_answers(streams: list[Stream], refs: list[Reference], max_tokens: int) -> None:
    """fp32: the in-process engine's answers, token for token. Quantized modes: no error
    event and a complete answer. The text may differ there: the cluster computes a prompt
    in other shapes than the reference run did (a prefix-cache hit on the hosts' own
    caches, a failover's recompute), whose rounding differs at the 1e-7 level, and int8
    activations turn that into another token now and then (exactness across paths is
    fp32-only, as in test_failover)."""
    for s, ref in zip(streams, refs, strict=True):
        assert s.done and not s.errors, s
        if TEST_QUANTIZATION == "none":
            assert s.result() == ref
            continue
        assert s.texts and 1 <= (s.num_tokens or 0) <= max_tokens, s
        assert s.finish_reason == "stop" or (s.finish_reason, s.num_tokens) == \
            ("length", max_tokens), s


def _token_ids(n: int, seed: int) -> list[int]:
    """`n` token ids no chat prompt starts with (no shared first block with anything else)."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


# -- the tests ----------------------------------------------------------------------------------

async def test_both_gateways_serve_answers_identical_to_the_in_process_engine(c, reference):
    registered = c.registered()
    assert set(registered) == {e.address for e in c.engines}, registered  # own, real addresses
    answers = await asyncio.gather(*(_chat(c, c.gateways[i % 2], m, PARITY_MAX_TOKENS)
                                     for i, m in enumerate(PARITY)))
    assert answers == reference["parity"]


async def test_a_repeated_long_prefix_is_served_from_the_hosts_holding_it(c):
    prefix = _token_ids(480, seed=15)  # 30 full blocks
    before = await _scrape(c, c.engines)
    r = await c.http.post(f"{c.gateways[0].url}/v1/completions", json={
        "model": MODEL, "prompt": prefix + [501, 502, 503, 504], "max_tokens": 2,
        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    first = await _scrape(c, c.engines)

    def grew(name: str, i: int) -> float:
        return first[i].get(name, 0) - before[i].get(name, 0)

    holder_p = max(range(2), key=lambda i: grew("pdserve_prompt_tokens_total", i))
    holder_d = max(range(2, 4), key=lambda i: grew("pdserve_request_success_total", i))
    registered = c.registered()
    for holder in (c.engines[holder_p], c.engines[holder_d]):  # published to Redis
        key = f"pdserve:held:{registered[holder.address]}"
        await _until(lambda key=key: c.redis.scard(key) >= 30, f"{key} to be published", 30)
    # ... and in each gateway's view (refreshed in the background, about once a second):
    # wait for a refresh that began after the publication
    published = time.monotonic()

    async def refreshed_since(url: str) -> bool:
        age = (await c.http.get(f"{url}/health")).json()["redis"]["view_age_s"]
        return age is not None and age + 0.1 < time.monotonic() - published

    for gw in c.gateways:
        await _until(lambda gw=gw: refreshed_since(gw.url), f"{gw.url}'s view", 30, 0.2)
    for k, gw in enumerate((c.gateways[1], c.gateways[0])):
        suffix = [600 + 10 * k + j for j in range(6)]
        r = await c.http.post(f"{gw.url}/v1/completions", json={
            "model": MODEL, "prompt": prefix + suffix, "max_tokens": 2, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
    # NOTE: the prefix-cache counters come from the engines' stats, which the services
    # publish on their heartbeat (not per request): poll until they have caught up.
    deadline = time.monotonic() + 15
    while True:
        after = await _scrape(c, c.engines)
        caught_up = after[holder_p].get("pdserve_prefix_cache_hits_total", 0) \
            - first[holder_p].get("pdserve_prefix_cache_hits_total", 0) >= 2 * 480
        if caught_up or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)

    def delta(name: str, i: int) -> int:
        return int(after[i].get(name, 0) - first[i].get(name, 0))

    hits = [delta("pdserve_prefix_cache_hits_total", i) for i in range(4)]
    prompts = [delta("pdserve_prompt_tokens_total", i) for i in range(4)]
    NUMBERS["prefix"] = {"holders": [holder_p, holder_d], "hits": hits, "prompt": prompts}
    # both repeats hit the whole prefix there
    assert hits[holder_p] >= 2 * 480, NUMBERS["prefix"]
    assert delta("pdserve_prompt_tokens_total", 1 - holder_p) == 0  # the other never saw them
    assert delta("pdserve_request_success_total", holder_d) == 2
    assert delta("pdserve_request_success_total", 5 - holder_d) == 0  # 2 <-> 3
    received = delta("pdserve_kv_transfer_blocks_received_total", holder_d)
    assert received <= 2 * 2, received  # it reused its own 30 blocks; fetched only the tail


async def test_a_decode_host_that_joins_gets_requests_within_10_s(c):
    pids = [p.process.proc.pid for p in (*c.engines, *c.gateways)]
    c.joiner.start(c.redis_url)
    c.decodes.append(c.joiner)
    await _until(lambda: _health(c.joiner.address, 0.5) ==
                 health_pb2.HealthCheckResponse.SERVING, "the joiner to serve", 300, 0.1)
    stop = asyncio.Event()

    async def client(i: int) -> int:
        """Chats back to back through gateway i % 2 until told to stop; how many. (Not in
        rounds: a round waits for its slowest chat, and on a loaded machine that wait, not
        the gateways, decided when the joiner got its first request.)"""
        n = 0
        while not stop.is_set():
            await _chat(c, c.gateways[i % 2], [{
                "role": "user", "content": f"Say the number {8 * n + i} in words."}], 4)
            n += 1
        return n

    async def traffic() -> int:
        """8 clients at once (4 per gateway); the number of chats they sent."""
        return sum(await asyncio.gather(*(client(i) for i in range(8))))

    async def joiner_has_work() -> bool:
        if sender.done():
            sender.result()  # a failed request fails the test here
        m = await _metrics(c, c.joiner.metrics_url)
        return any(m.get(name, 0) > 0 for name in (
            "pdserve_num_requests_running", "pdserve_num_requests_waiting",
            "pdserve_request_success_total"))

    sender = asyncio.ensure_future(traffic())
    try:
        received_s = await _until(joiner_has_work, "the joiner to get a request",
                                  JOIN_BOUND_S, 0.1)
    finally:
        stop.set()
        num_sent = await asyncio.wait_for(sender, 120)
    NUMBERS["join"] = {"first_request_s": round(received_s, 2), "requests_sent": num_sent}
    assert [p.process.proc.pid for p in (*c.engines[:4], *c.gateways)] == pids
    assert all(p.process.alive for p in (*c.engines, *c.gateways))


async def test_a_cut_decode_host_fails_over_and_leaves_redis_within_one_ttl(c, reference):
    failovers = await _decode_failovers(c)
    streams, tasks = await _start_streams(c, CUT_STREAMS, min_chunks=3)
    victim, running = await _busiest_decode(c, streams)
    assert running >= 1
    instance_id = c.registered()[victim.address]
    cut_at = time.monotonic()
    victim.host.cut()
    gone_s = await _until(lambda: not c.redis.exists(f"pdserve:instance:{instance_id}"),
                          "the cut host's registration to expire", 30, 0.05)
    await asyncio.wait_for(asyncio.gather(*tasks), 180)
    NUMBERS["cut"] = {"running_on_victim": running, "gone_from_redis_s": round(gone_s, 2),
                      "streams_done_s": round(time.monotonic() - cut_at, 2)}
    assert gone_s <= TTL_S + 0.25, gone_s
    _assert_answers(streams, reference["cut"], STREAM_MAX_TOKENS)
    assert await _decode_failovers(c) - failovers >= 1
    victim.host.restore()  # it comes back and registers again
    NUMBERS["cut"]["rejoined_s"] = round(await _until(
        lambda: victim.address in c.registered(), "the restored host to register", 30), 2)


def _retries(c: Cluster) -> list[str]:
    """The gateways' log lines of failed attempts placed again, in log order per gateway."""
    return [line for g in c.gateways
            for line in g.process.log_path.read_text(errors="replace").splitlines()
            if " failed (" in line and "; retry " in line]


async def test_a_decode_host_drained_on_sigterm_finishes_its_streams(c, reference):
    failovers = await _decode_failovers(c)
    retries_before = set(_retries(c))
    streams, tasks = await _start_streams(c, DRAIN_STREAMS, min_chunks=2,
                                          max_tokens=DRAIN_MAX_TOKENS)
    victim, running = await _busiest_decode(c, streams)
    assert running >= 1
    victim.process.terminate()
    gone_s = await _until(lambda: victim.address not in c.registered(),
                          "the draining host to leave Redis", TTL_S)
    await asyncio.wait_for(asyncio.gather(*tasks), 180)
    _assert_answers(streams, reference["drain"], DRAIN_MAX_TOKENS)
    # finished where they ran: no attempt on the draining host failed (a retry elsewhere,
    # e.g. a host's channel reconnecting under load, is not this test's concern: counted)
    retries = [line for line in _retries(c) if line not in retries_before]
    assert not [line for line in retries if f"failed (decode {victim.address}:" in line], retries
    code = await asyncio.to_thread(victim.process.wait, GRACE_S + 15)
    NUMBERS["drain"] = {"running_on_victim": running, "left_redis_s": round(gone_s, 2),
                        "decode_failovers": await _decode_failovers(c) - failovers,
                        "retries": retries}
    assert code == 0, victim.process.log_tail()


async def test_afterwards_no_block_is_in_use_or_pinned_anywhere(c):
    engines = [e for e in c.engines if e.process.alive]
    assert len(engines) == 4  # 2 prefill + 2 decode (of 3, one drained)

    async def state(e: Engine) -> engine_pb2.EngineState:
        async with grpc.aio.insecure_channel(
                e.address, options=[("grpc.enable_http_proxy", 0)]) as ch:
            stub = (engine_pb2_grpc.PrefillServiceStub(ch) if e.role == "prefill"
                    else engine_pb2_grpc.DecodeServiceStub(ch))
            return await stub.GetState(engine_pb2.GetStateRequest(check_invariants=True),
                                       timeout=30,
                                       metadata=(("authorization", f"Bearer {TOKEN}"),))

    async def idle() -> bool:
        states = await asyncio.gather(*(state(e) for e in engines))
        return all(s.num_used_blocks == s.num_pinned_blocks == s.num_running == s.num_waiting
                   == 0 for s in states)

    await _until(idle, "every pool to be idle", 30, 0.2)
    for s in await asyncio.gather(*(state(e) for e in engines)):
        assert s.invariants_ok, s.invariants_error
    leaving = c.prefills[1]
    leaving.process.terminate()
    await _until(lambda: leaving.address not in c.registered(), "the prefill to leave", TTL_S)
    assert await asyncio.to_thread(leaving.process.wait, GRACE_S + 15) == 0
