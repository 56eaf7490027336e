"""End-to-end faults of the disk tier: the real gateway (uvicorn, the official `openai` client)
in front of a real decode instance with `--kv-offload-dir` (in-process grpc.aio, a real
engine), unified as `pdserve up`'s default: no prefill instance, so the decode instance
prefills every prompt itself and its disk tier serves the prefixes.

Each test is a two-turn chat whose first turn is evicted to disk between the turns; then
(a) a block file is corrupted, (b) the disk is full (a real ENOSPC: the tier directory is a
small tmpfs, filled up by a ballast file beside the tier's own directory), (c) the tier's
directory is deleted. Each ends with the answer of an engine without the tier, no 5xx nor
gRPC error, nothing leaked (the leak audit, the disk tier's own included), and the fault
counted in `pdserve_kv_tier_failures_total`."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto import engine_pb2_grpc
from pdserve.shared.kv_cache.disk_store import HEADER_NBYTES
from pdserve.shared.request import Request
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.tokenizer import apply_chat_template
from tests.conftest import PARITY_MESSAGES
from tests.e2e.conftest import Urls
from tests.kv_tiers import evict_all
from tests.services.gateway.conftest import SERVED_MODEL, running_gateway
from tests.services.helpers import RPC_TIMEOUT, channel, engine_args, service_config, start_runtime

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow,
              pytest.mark.fp32_only]

TIER_ENGINE = dict(num_gpu_blocks_override=45, max_model_len=512, kv_offload_size="1GiB")
MAX_TOKENS = 24
FOLLOW_UP = "Say that again in one short sentence."
TMPFS_SIZE = "96m"


def conversations(answers: list[str] | None = None) -> list[list[list[dict]]]:
    """Per test: [turn 1 messages, turn 2 messages] (turn 2 holds turn 1's answer)."""
    out = []
    for i, first in enumerate((PARITY_MESSAGES[0], PARITY_MESSAGES[2], PARITY_MESSAGES[4])):
        second = [*first, {"role": "assistant", "content": answers[i] if answers else ""},
                  {"role": "user", "content": FOLLOW_UP}]
        out.append([list(first), second])
    return out


@pytest.fixture(scope="module")
def reference(model_path) -> list[list[tuple[str, int]]]:
    """(text, completion tokens) of each turn from an engine without the tier."""
    from pdserve.shared.llm import LLM

    llm = LLM(model_path, max_model_len=512, kv_cache_memory="64MiB",
              enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    firsts = [o.outputs[0] for o in llm.chat([c[0] for c in conversations()], greedy)]
    seconds = [o.outputs[0] for o in llm.chat(
        [c[1] for c in conversations([o.text for o in firsts])], greedy)]
    llm.engine.shutdown()
    return [[(a.text, len(a.token_ids)), (b.text, len(b.token_ids))]
            for a, b in zip(firsts, seconds)]


@pytest.fixture(scope="module")
def tier_dir() -> Iterator[tuple[str, bool]]:
    """(the tier directory, whether it is a tmpfs of TMPFS_SIZE: a disk that can fill)."""
    path = tempfile.mkdtemp(prefix="pdserve-kv-tier-")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs",
                              path], capture_output=True).returncode == 0
    yield path, mounted
    if mounted:
        subprocess.run(["umount", "-l", path], check=False)
    shutil.rmtree(path, ignore_errors=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def decode(model_path, tier_dir, reference):
    runtime = await start_runtime(service_config("decode", None),
                                  engine_args(model_path, kv_offload_dir=tier_dir[0],
                                              **TIER_ENGINE))
    try:
        await runtime.wait_ready(300)
        yield runtime
    finally:
        await runtime.stop(0.5)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(model_path, decode) -> AsyncIterator:
    urls = Urls((), (decode.identity.address,))  # unified: the decode instance prefills
    async with running_gateway(model_path, urls, rpc_timeout=60.0) as gw:  # type: ignore[arg-type]
        gw.client = gw.client.with_options(timeout=120)
        yield gw


async def chat_turn(gateway, messages) -> tuple[str, int, int]:
    """(text, completion tokens, cached prompt tokens) of a greedy chat over HTTP; the
    `openai` client raises on any 4xx / 5xx."""
    resp = await gateway.client.chat.completions.create(
        model=SERVED_MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    details = resp.usage.prompt_tokens_details
    return (resp.choices[0].message.content, resp.usage.completion_tokens,
            (details.cached_tokens or 0) if details else 0)


async def tier_counters(decode) -> dict[str, float]:
    """The decode instance's `pdserve_kv_tier_*_total{tier="disk"}` from its /metrics, by
    name (`failures:load`, `failures:store` for the two ops); absent until first counted."""
    await decode.monitor.tick()
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{decode.metrics_port}/metrics")).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels = sample.name, sample.labels
            if name.startswith("pdserve_kv_tier_") and name.endswith("_total") and \
                    labels.get("tier") == "disk":
                key = name[len("pdserve_kv_tier_"):-len("_total")]
                out[f"{key}:{labels['op']}" if "op" in labels else key] = sample.value
    return out


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


async def assert_leak_free(decode, timeout: float = 30.0) -> None:
    """The leak audit over gRPC (GetState with check_invariants: the pool, the requests'
    blocks, and the disk tier's files), polled until the instance is idle."""
    loop = asyncio.get_running_loop()
    async with channel(decode.identity.address) as ch:
        stub = engine_pb2_grpc.DecodeServiceStub(ch)
        deadline = loop.time() + timeout
        while True:
            s = await stub.GetState(pb.GetStateRequest(check_invariants=True),
                                    timeout=RPC_TIMEOUT)
            idle = s.num_used_blocks == s.num_running == s.num_waiting == 0
            if (idle and s.invariants_ok) or loop.time() > deadline:
                break
            await asyncio.sleep(0.05)
    assert idle and s.invariants_ok, (s.num_used_blocks, s.invariants_error)


async def first_turn_on_disk(gateway, decode, conversation, expected) -> None:
    assert (await chat_turn(gateway, conversation[0]))[:2] == expected
    await decode.worker.engine.call(evict_all)


def block_hashes(decode, tokenizer, messages) -> list[bytes]:
    core = decode.worker.engine.engine_core
    ids = apply_chat_template(tokenizer, messages)
    return Request("probe", ids, SamplingParams(),
                   block_hasher=core.kv_cache_manager.block_hasher).block_hashes


async def test_a_corrupt_block_is_recomputed(gateway, decode, reference, tokenizer):
    conversation = conversations([r[0][0] for r in reference])[0]
    await first_turn_on_disk(gateway, decode, conversation, reference[0][0])
    store = decode.worker.engine.engine_core.kv_offloader.store
    hashes = block_hashes(decode, tokenizer, conversation[1])
    assert hashes[0] in store and hashes[1] in store
    with open(store._path(hashes[1]), "r+b") as f:  # one bit of turn 1's second block
        f.seek(HEADER_NBYTES + 1000)
        byte = f.read(1)[0]
        f.seek(HEADER_NBYTES + 1000)
        f.write(bytes([byte ^ 0x10]))
    before = await tier_counters(decode)

    text, n, cached = await chat_turn(gateway, conversation[1])
    assert (text, n) == reference[0][1]
    assert cached == 16  # block 0 from disk; block 1 failed its checksum: recomputed on
    after = await tier_counters(decode)
    assert delta(after, before, "failures:load") == 1
    assert delta(after, before, "loads") == 1
    assert hashes[1] not in store and hashes[0] in store
    await assert_leak_free(decode)


async def test_a_full_disk_drops_writes_and_serves_on(gateway, decode, reference, tier_dir):
    path, is_tmpfs = tier_dir
    if not is_tmpfs:
        pytest.skip("mount -t tmpfs is not permitted here; the full disk is covered by "
                    "test_disk_store.py::test_full_disk_drops_the_write (ENOSPC monkeypatched)")
    conversation = conversations([r[0][0] for r in reference])[1]
    store = decode.worker.engine.engine_core.kv_offloader.store
    ballast = os.path.join(path, "ballast")  # beside the tier's directory, not in it
    st = os.statvfs(path)
    room = 2 * store.file_nbytes + store.file_nbytes // 2  # two blocks fit, then ENOSPC
    with open(ballast, "wb") as f:
        f.write(b"\0" * (st.f_bavail * st.f_frsize - room))
    before = await tier_counters(decode)
    try:
        await first_turn_on_disk(gateway, decode, conversation, reference[1][0])
        mid = await tier_counters(decode)
        assert delta(mid, before, "failures:store") >= 1
        assert delta(mid, before, "stores") <= 2
        await assert_leak_free(decode)  # no partial file left by a failed write
        text, n, _ = await chat_turn(gateway, conversation[1])
        assert (text, n) == reference[1][1]
    finally:
        os.unlink(ballast)
    mid = await tier_counters(decode)
    await decode.worker.engine.call(evict_all)  # room again: writes go through
    after = await tier_counters(decode)
    assert delta(after, mid, "stores") >= 1 and delta(after, mid, "failures:store") == 0
    text, n, cached = await chat_turn(gateway, conversation[1])
    assert (text, n) == reference[1][1] and cached >= 16
    await assert_leak_free(decode)


async def test_a_deleted_tier_directory_is_made_again(gateway, decode, reference):
    conversation = conversations([r[0][0] for r in reference])[2]
    await first_turn_on_disk(gateway, decode, conversation, reference[2][0])
    store = decode.worker.engine.engine_core.kv_offloader.store
    before = await tier_counters(decode)
    shutil.rmtree(store.root)

    text, n, cached = await chat_turn(gateway, conversation[1])
    assert (text, n) == reference[2][1] and cached == 0
    mid = await tier_counters(decode)
    assert delta(mid, before, "failures:load") == 1  # the load stops at its first block
    assert delta(mid, before, "loads") == 0
    await assert_leak_free(decode)

    await decode.worker.engine.call(evict_all)  # the next write makes the directory again
    assert os.path.isdir(store.root)
    after = await tier_counters(decode)
    assert delta(after, mid, "stores") >= 1
    text, n, cached = await chat_turn(gateway, conversation[1])
    assert (text, n) == reference[2][1] and cached >= 16
    assert delta(await tier_counters(decode), after, "loads") >= 1
    await assert_leak_free(decode)


async def test_a_client_gone_while_its_prefix_loads_leaves_nothing_held(
        gateway, decode, reference, monkeypatch):
    """The client disconnects while the loader reads its prefix (held at a gate): the abort
    reaches the engine mid-load, and the blocks are freed once the load ends, with no
    other request arriving to make the engine step."""
    conversation = conversations([r[0][0] for r in reference])[0]
    await first_turn_on_disk(gateway, decode, conversation, reference[0][0])
    core = decode.worker.engine.engine_core
    store, transfers = core.kv_offloader.store, core.scheduler.kv_transfers
    gate, reading = threading.Event(), threading.Event()
    get_into = store.get_into

    def gated_get_into(block_hash, out):
        reading.set()
        gate.wait(30)
        return get_into(block_hash, out)

    monkeypatch.setattr(store, "get_into", gated_get_into)
    task = asyncio.ensure_future(chat_turn(gateway, conversation[0]))
    try:
        assert await asyncio.to_thread(reading.wait, 30)  # the load is in flight
        task.cancel()  # the client goes: the gateway aborts the request
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while not transfers.aborted_loading:
            assert loop.time() < deadline, "the abort did not reach the engine"
            await asyncio.sleep(0.01)
        state = await decode.worker.get_state(check_invariants=True)
        assert state.num_used_blocks > 0 and not state.invariants_error  # held, owned
    finally:
        gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_leak_free(decode, timeout=10)
