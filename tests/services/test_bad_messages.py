"""Bad input gets a gRPC status with a clear message, never a crash, and no block stays
allocated: unknown ids, indices out of range, bad handles, bad chunks, cut transfers."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import pytest_asyncio

from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto import engine_pb2_grpc
from pdserve.shared.kv_cache.prefix_hash import block_extra_keys, hash_request_tokens
from tests.services.helpers import RPC_TIMEOUT, greedy, num_handle_blocks, wait_leak_free

pytestmark = pytest.mark.asyncio(loop_scope="session")
Code = grpc.StatusCode


def _prompt(seed: int, n: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


async def _status(coro) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    return info.value.code(), info.value.details()


async def _generate(cluster, req: pb.DecodeRequest) -> list[pb.TokenChunk]:
    return [c async for c in cluster.decode_stub.Generate(req, timeout=RPC_TIMEOUT)]


async def _assert_no_leak(cluster) -> None:
    for state in await wait_leak_free(cluster):
        assert state.num_used_blocks == 0 and state.num_pinned_blocks == 0, state
        assert state.invariants_ok, state.invariants_error


# -- prefill ---------------------------------------------------------------------------------

async def test_fetch_unknown_request_is_not_found(cluster):
    code, details = await _status(_collect(cluster.prefill_stub.FetchKV(
        pb.FetchKVRequest(request_id="never-prefilled"), timeout=RPC_TIMEOUT)))
    assert code == Code.NOT_FOUND and "never-prefilled" in details


async def test_fetch_indices_out_of_range_or_repeated(cluster):
    resp = await cluster.prefill_stub.Prefill(pb.PrefillRequest(
        request_id="oor", prompt_token_ids=_prompt(1, 40), sampling_params=greedy(8)),
        timeout=RPC_TIMEOUT)
    num_blocks = num_handle_blocks(resp.kv_transfer_params)
    for indices, text in (([0, num_blocks], "out of range"), ([-1], "out of range"),
                          ([1, 1], "repeated")):
        code, details = await _status(_collect(cluster.prefill_stub.FetchKV(
            pb.FetchKVRequest(request_id="oor", block_indices=indices), timeout=RPC_TIMEOUT)))
        assert code == Code.INVALID_ARGUMENT and text in details
    released = await cluster.prefill_stub.ReleaseKV(pb.ReleaseKVRequest(request_id="oor"),
                                                    timeout=RPC_TIMEOUT)
    assert released.released
    again = await cluster.prefill_stub.ReleaseKV(pb.ReleaseKVRequest(request_id="oor"),
                                                 timeout=RPC_TIMEOUT)
    assert not again.released
    await _assert_no_leak(cluster)


@pytest.mark.parametrize("params, field", [
    (pb.SamplingParams(temperature=-1.0), "temperature"),
    (pb.SamplingParams(top_p=1.5), "top_p"),
    (pb.SamplingParams(max_tokens=2, min_tokens=5), "min_tokens"),
    (pb.SamplingParams(logprobs=50), "logprobs"),
])
async def test_bad_sampling_params_are_invalid_argument(cluster, params, field):
    prompt = _prompt(2, 20)
    code, details = await _status(cluster.prefill_stub.Prefill(pb.PrefillRequest(
        request_id="bad-params", prompt_token_ids=prompt, sampling_params=params),
        timeout=RPC_TIMEOUT))
    assert code == Code.INVALID_ARGUMENT and details.startswith(field)
    code, details = await _status(_generate(cluster, pb.DecodeRequest(
        request_id="bad-params", prompt_token_ids=prompt, sampling_params=params)))
    assert code == Code.INVALID_ARGUMENT and details.startswith(field)


@pytest.mark.parametrize("prompt, text", [
    ([], "empty"), ([5, 99999], "vocabulary"), ([5] * 9000, "max_model_len"),
])
async def test_bad_prompts_are_invalid_argument(cluster, prompt, text):
    code, details = await _status(cluster.prefill_stub.Prefill(pb.PrefillRequest(
        request_id="bad-prompt", prompt_token_ids=prompt, sampling_params=greedy(4)),
        timeout=RPC_TIMEOUT))
    assert code == Code.INVALID_ARGUMENT and text in details
    code, details = await _status(_generate(cluster, pb.DecodeRequest(
        request_id="bad-prompt", prompt_token_ids=prompt, sampling_params=greedy(4))))
    assert code == Code.INVALID_ARGUMENT and text in details
    await _assert_no_leak(cluster)


async def test_duplicate_request_id_is_already_exists(cluster):
    req = pb.PrefillRequest(request_id="dup", prompt_token_ids=_prompt(3, 30),
                            sampling_params=greedy(8))
    await cluster.prefill_stub.Prefill(req, timeout=RPC_TIMEOUT)
    code, _ = await _status(cluster.prefill_stub.Prefill(req, timeout=RPC_TIMEOUT))
    assert code == Code.ALREADY_EXISTS
    await cluster.prefill_stub.ReleaseKV(pb.ReleaseKVRequest(request_id="dup"),
                                         timeout=RPC_TIMEOUT)
    await _assert_no_leak(cluster)


# -- decode: bad handles ---------------------------------------------------------------------

@pytest_asyncio.fixture(loop_scope="session")
async def prefilled(cluster):
    """A real handle (released by the test's end)."""
    prompt = _prompt(4)
    resp = await cluster.prefill_stub.Prefill(pb.PrefillRequest(
        request_id="handle", prompt_token_ids=prompt, sampling_params=greedy(8)),
        timeout=RPC_TIMEOUT)
    yield prompt, resp
    await cluster.prefill_stub.ReleaseKV(pb.ReleaseKVRequest(request_id="handle"),
                                         timeout=RPC_TIMEOUT)


def _decode_request(prompt, resp, **handle_changes) -> pb.DecodeRequest:
    handle = pb.KVTransferParams()
    handle.CopyFrom(resp.kv_transfer_params)
    for name, value in handle_changes.items():
        if name == "block_hashes":
            del getattr(handle, name)[:]
            getattr(handle, name).extend(value)
        else:
            setattr(handle, name, value)
    return pb.DecodeRequest(request_id="handle", prompt_token_ids=prompt,
                            output_token_ids=[resp.first_token_id], sampling_params=greedy(8),
                            kv_transfer_params=handle)


@pytest.mark.parametrize("changes, text", [
    ({"dtype": "float16"}, "layout"),
    ({"num_kv_heads": 4}, "layout"),
    ({"head_dim": 32}, "layout"),
    ({"model": "other-model"}, "model"),
    ({"num_tokens": 500}, "num_tokens"),
    ({"block_hashes": [b"\0" * 16] * 2}, "block_hashes"),
    ({"block_hashes": [b"\0" * 16] * 6}, "block_hashes"),
    ({"prefill_address": ""}, "prefill_address"),
])
async def test_bad_handle_is_invalid_argument(cluster, prefilled, changes, text):
    code, details = await _status(_generate(cluster, _decode_request(*prefilled, **changes)))
    assert code == Code.INVALID_ARGUMENT and text in details
    _, decode_state = await wait_leak_free(cluster, decode_only=True)
    assert decode_state.num_used_blocks == 0


async def test_released_handle_is_not_found(cluster):
    prompt = _prompt(5)
    resp = await cluster.prefill_stub.Prefill(pb.PrefillRequest(
        request_id="gone", prompt_token_ids=prompt, sampling_params=greedy(8)),
        timeout=RPC_TIMEOUT)
    await cluster.prefill_stub.ReleaseKV(pb.ReleaseKVRequest(request_id="gone"),
                                         timeout=RPC_TIMEOUT)
    req = _decode_request(prompt, resp)
    req.request_id = "gone"
    code, details = await _status(_generate(cluster, req))
    assert code == Code.NOT_FOUND and "gone" in details
    await _assert_no_leak(cluster)


# -- decode: bad chunks from a (fake) prefill instance ---------------------------------------

class BadPrefill(engine_pb2_grpc.PrefillServiceServicer):
    """Streams well-formed chunks, except for the flaw named by the request id's prefix."""

    def __init__(self, layout) -> None:
        self.layout = layout
        self.released: list[str] = []

    async def FetchKV(self, request, context):
        num_layers, block_size, heads, head_dim = self.layout[:4]
        flaw = request.request_id.split(":")[0]
        indices = list(request.block_indices)
        for n, start in enumerate(range(0, len(indices), 5)):
            part = indices[start:start + 5]
            shape = [num_layers, 2, len(part), block_size, heads, head_dim]
            dtype, itemsize = "float32", 4
            if flaw == "dtype":
                dtype, itemsize = "bfloat16", 2
            if flaw == "shape":
                shape[4] = heads + 1
            size = itemsize
            for dim in shape:
                size *= dim
            data = bytes(size - (4 if flaw == "length" else 0))
            if flaw == "stray":
                part = [p + 1000 for p in part]
            if flaw == "truncated" and n == 1:
                return
            if flaw == "abort" and n == 1:
                await context.abort(Code.UNAVAILABLE, "prefill went away")
            yield pb.KVChunk(request_id=request.request_id, block_indices=part, dtype=dtype,
                             shape=shape, data=data)

    async def ReleaseKV(self, request, context):
        self.released.append(request.request_id)
        return pb.ReleaseKVResponse(released=True)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def bad_prefill(cluster):
    servicer = BadPrefill(cluster.decode.worker.layout)
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
    engine_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await asyncio.wait_for(server.stop(0), 30)


@pytest.mark.parametrize("flaw, code, text", [
    ("dtype", Code.DATA_LOSS, "dtype"),
    ("shape", Code.DATA_LOSS, "shape"),
    ("length", Code.DATA_LOSS, "bytes"),
    ("stray", Code.DATA_LOSS, "not requested"),
    ("truncated", Code.DATA_LOSS, "truncated"),
    ("abort", Code.ABORTED, "UNAVAILABLE: prefill went away"),
])
async def test_bad_chunks_fail_the_request_and_free_its_blocks(cluster, bad_prefill, flaw,
                                                              code, text):
    servicer, address = bad_prefill
    worker = cluster.decode.worker
    prompt = _prompt(6, 150)  # 10 blocks: two chunks of at most 5
    num_tokens = len(prompt)
    hashes = hash_request_tokens(prompt, 16, block_extra_keys(worker.model_name, None,
                                                              worker.quantization))
    layout = worker.layout
    handle = pb.KVTransferParams(
        prefill_address=address, block_hashes=hashes, num_tokens=num_tokens,
        dtype=layout.dtype, num_layers=layout.num_layers, block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, model=worker.model_name,
        quantization=worker.quantization)
    rid = f"{flaw}:1"
    req = pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, output_token_ids=[42],
                           sampling_params=greedy(8), kv_transfer_params=handle)
    got_code, details = await _status(_generate(cluster, req))
    assert got_code == code and text in details, details
    _, decode_state = await wait_leak_free(cluster, decode_only=True)
    assert decode_state.num_used_blocks == 0
    # Nothing half-written became findable by its hash.
    assert not set(hashes) & await _cached(cluster.decode)
    for _ in range(100):  # ReleaseKV goes out in the background
        if rid in servicer.released:
            break
        await asyncio.sleep(0.05)
    assert rid in servicer.released


async def _cached(runtime) -> set[bytes]:
    return await runtime.worker.engine.call(
        lambda e: set(e.kv_cache_manager.block_pool.cached_block_hash_to_block))


async def _collect(call) -> list:
    return [item async for item in call]
