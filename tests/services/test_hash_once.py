"""Each engine hashes a request's prompt once (issue 33): the prefill when the engine adds the
request, the decode when it makes it (`DecodeWorker.make_request`), and the decode checks the
prefill's KV handle against those hashes instead of hashing the prompt again. Through real
prefill and decode services, by counting the blocks each engine's `block_hasher` hashes."""

from __future__ import annotations

from collections import defaultdict

import pytest

from pdserve.services.proto import engine_pb2 as pb
from tests.services.helpers import RPC_TIMEOUT, greedy, run_split, wait_leak_free

pytestmark = pytest.mark.asyncio(loop_scope="session")


def count_hashing(monkeypatch, engine_core) -> dict[str, list[range]]:
    """request_id -> the block indices each call of the engine's block hasher hashed."""
    kv = engine_core.kv_cache_manager
    real = kv.block_hasher
    calls: dict[str, list[range]] = defaultdict(list)

    def counting(request):
        start = len(request.block_hashes)
        new = real(request)
        if new:
            calls[request.request_id].append(range(start, start + len(new)))
        return new

    monkeypatch.setattr(kv, "block_hasher", counting)
    return calls


@pytest.fixture
def hashings(cluster, monkeypatch) -> dict[str, dict[str, list[range]]]:
    return {role: count_hashing(monkeypatch, runtime.worker.engine_core)
            for role, runtime in (("prefill", cluster.prefill), ("decode", cluster.decode))}


def prompt_hashings(calls: list[range], num_prompt_blocks: int) -> list[range]:
    """The calls that hashed a block of the prompt."""
    return [r for r in calls if r.start < num_prompt_blocks]


async def test_a_split_request_hashes_its_prompt_once_per_engine(cluster, parity_prompt_ids,
                                                                 hashings):
    prompt = parity_prompt_ids[0] * 4
    num_blocks = len(prompt) // cluster.prefill.worker.block_size
    assert num_blocks >= 2
    result = await run_split(cluster, "hash-once-split", prompt, greedy(6, ignore_eos=True))
    assert len(result.token_ids) == 6
    for role in ("prefill", "decode"):
        calls = hashings[role]["hash-once-split"]
        assert prompt_hashings(calls, num_blocks) == [range(0, num_blocks)], (role, calls)
    await wait_leak_free(cluster)


async def test_a_local_prefill_on_the_decode_hashes_its_prompt_once(cluster, parity_prompt_ids,
                                                                    hashings):
    prompt = parity_prompt_ids[1] * 3
    num_blocks = len(prompt) // cluster.decode.worker.block_size
    req = pb.DecodeRequest(request_id="hash-once-local", prompt_token_ids=prompt,
                           sampling_params=greedy(4, ignore_eos=True))
    chunks = [c async for c in cluster.decode_stub.Generate(req, timeout=RPC_TIMEOUT)]
    assert sum(len(c.token_ids) for c in chunks) == 4
    calls = hashings["decode"]["hash-once-local"]
    assert prompt_hashings(calls, num_blocks) == [range(0, num_blocks)], calls
    assert "hash-once-local" not in hashings["prefill"]
    await wait_leak_free(cluster)
