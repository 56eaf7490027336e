"""The CUDA path's device plumbing, checked on the meta device as a stand-in for the GPU.

A tensor made on the CPU and combined with a meta tensor raises, as it would against a CUDA
tensor, so running the `--device cuda` code on `torch.device("meta")` catches tensors
created on the wrong device without a GPU (values are not computed: only code that never
reads a tensor back to the host runs here). The Triton kernels' launch checks (shapes,
strides, devices) run on what the model hands them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kernels import torch_paged
from pdserve.kernels.attn_metadata import AttentionMetadata, build_attn_metadata
from pdserve.kernels.triton_common import check_paged_attention_inputs
from pdserve.kernels.triton_store import check_store_kv_cache_inputs
from pdserve.shared.engine.sampler import (
    _compute_logprobs,
    _truncate,
    apply_logit_bias,
    apply_min_tokens,
)
from pdserve.shared.engine.sampling_metadata import SamplingMetadata
from pdserve.shared.kv_transfer.codec import write_kv_blocks
from pdserve.shared.models.loader import load_model
from pdserve.shared.models.rotary import RotaryEmbedding
from pdserve.shared.request import Request
from pdserve.shared.sampling_params import SamplingParams

META = torch.device("meta")
NUM_LAYERS = 2


@pytest.fixture(scope="module")
def small_model_path(model_path, tmp_path_factory) -> str:
    from tests.draft_model import write_truncated_model

    return write_truncated_model(model_path, tmp_path_factory.mktemp("small"), NUM_LAYERS)


class CheckedAttention:
    """Stands in for PagedAttention with the Triton backend: runs the kernels' launch
    checks on what a layer passes, returns zeros."""

    def __init__(self, metadata: AttentionMetadata) -> None:
        self.metadata = metadata
        self.num_calls = 0

    def forward(self, query, key, value, k_cache, v_cache, scale, sliding_window=None,
                logits_soft_cap=None):
        out = torch.zeros_like(query)
        check_store_kv_cache_inputs(key, value, k_cache, v_cache, self.metadata.slot_mapping)
        check_paged_attention_inputs(query, k_cache, v_cache, self.metadata, out)
        self.num_calls += 1
        return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_model_forward_stays_on_the_device(small_model_path, dtype):
    model = load_model(small_model_path, dtype, "meta")
    torch_dtype = getattr(torch, dtype)
    assert {p.device for p in model.parameters()} == {META}
    assert model.rotary.cos.device == META and model.rotary.cos.dtype == torch_dtype
    # a chunk of 4 prompt tokens after 16 cached ones, and a decode
    meta, positions, _ = build_attn_metadata(np.array([16, 5]), np.array([4, 1]),
                                             [[3, 4], [2]], 16, META)
    assert {t.device for t in (meta.slot_mapping, meta.block_table, meta.seq_lens,
                               meta.query_start_loc, positions)} == {META}
    args = model.args
    shape = (8, 16, args.num_kv_heads, args.head_dim)
    kv_caches = [(torch.zeros(shape, dtype=torch_dtype, device=META),
                  torch.zeros(shape, dtype=torch_dtype, device=META))
                 for _ in range(args.num_hidden_layers)]
    attn = CheckedAttention(meta)
    input_ids = torch.from_numpy(np.arange(5)).to(META)
    hidden = model(input_ids, positions, kv_caches, attn)
    assert attn.num_calls == NUM_LAYERS
    assert (hidden.device, hidden.dtype, hidden.shape) == (META, torch_dtype, (5, 576))
    logits = model.compute_logits(hidden[torch.tensor([3, 4], device=META)])
    assert (logits.device, logits.dtype) == (META, torch.float32)  # the sampler's input


def test_rotary_tables_are_made_on_the_device():
    rotary = RotaryEmbedding(64, 32, 10000.0)
    cos, sin = rotary.cos.clone(), rotary.sin.clone()
    rotary.to("cpu", torch.float32)
    assert torch.equal(rotary.cos, cos) and torch.equal(rotary.sin, sin)
    rotary.to(META, torch.bfloat16)
    assert (rotary.cos.device, rotary.cos.dtype, rotary.cos.shape) == \
        (META, torch.bfloat16, (32, 64))
    assert (rotary.sin.device, rotary.sin.dtype) == (META, torch.bfloat16)


def _request(request_id: str, **params) -> Request:
    request = Request(request_id=request_id, prompt_token_ids=[5, 6, 7],
                      sampling_params=SamplingParams(**params), eos_token_id=2)
    request.output_token_ids.extend([8, 9])
    return request


def test_sampling_metadata_and_logit_processors_stay_on_the_device():
    requests = [
        _request("penalties", temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.5,
                 presence_penalty=0.3, top_k=5, top_p=0.9, logprobs=2),
        _request("min_tokens", temperature=0.0, min_tokens=10, stop_token_ids=[11],
                 logit_bias={3: 1.5}),
        _request("plain", temperature=1.0, min_p=0.1, seed=7),
    ]
    vocab_size = 32
    md = SamplingMetadata.from_requests(requests, vocab_size, META)
    tensors = [md.temperature, md.top_k, md.top_p, md.min_p, md.min_tokens_rows,
               md.min_tokens_token_ids, md.logit_bias_rows, md.logit_bias_token_ids,
               md.logit_bias_values]
    penalties = md.penalties
    assert penalties is not None
    tensors += [penalties.repetition_penalties, penalties.frequency_penalties,
                penalties.presence_penalties, penalties.prompt_token_ids,
                penalties.output_token_ids]
    assert {t.device for t in tensors} == {META}
    logits = torch.empty(len(requests), vocab_size, device=META)
    apply_min_tokens(logits, md)  # (apply_penalties: torch.unique has no meta kernel)
    apply_logit_bias(logits, md)
    rows, logprobs, top_values, top_ids = _compute_logprobs(logits, md)
    assert rows == [0] and logprobs.device == META and top_ids.device == META
    index = torch.tensor(md.truncated_rows, device=META)
    values, ids, covered = _truncate(logits[index], md.temperature[index], md.top_k[index],
                                     md.top_p[index], md.max_top_k, md.has_top_p, False)
    assert {values.device, ids.device, covered.device} == {META}


@pytest.mark.parametrize("device", [META, torch.device("cpu")], ids=["meta", "cpu"])
def test_kv_transfer_writes_host_chunks_into_device_blocks(device):
    """A host chunk from the wire (layers 1-2, K and V, two blocks) lands in blocks 4 and 1
    of those layers' caches on the cache's device: on meta (the stand-in for CUDA) the copy
    must not mix devices; on the CPU the values are checked, and nothing else is written."""
    kv_caches = [(torch.zeros(6, 16, 2, 8, device=device),
                  torch.zeros(6, 16, 2, 8, device=device)) for _ in range(3)]
    data = torch.randn(2, 2, 2, 16, 2, 8)
    write_kv_blocks(kv_caches, [4, 1], 1, data)
    for k_cache, v_cache in kv_caches:
        assert k_cache.device == v_cache.device == device
        assert k_cache.shape == v_cache.shape == (6, 16, 2, 8)
    if device.type == "meta":
        return
    for layer in (1, 2):
        for kv in (0, 1):
            cache = kv_caches[layer][kv]
            torch.testing.assert_close(cache[4], data[layer - 1, kv, 0], rtol=0, atol=0)
            torch.testing.assert_close(cache[1], data[layer - 1, kv, 1], rtol=0, atol=0)
            assert not cache[[0, 2, 3, 5]].any()
    assert not kv_caches[0][0].any() and not kv_caches[0][1].any()


def test_torch_backend_follows_the_block_table_device():
    """`--attention-backend torch` on CUDA: the per-step indices go where the cache is (the
    host reads only seq_lens and query_start_loc, kept on the CPU here)."""
    num_kv_heads, head_dim = 2, 8
    seq_lens, query_lens = [20, 7, 5], [1, 1, 5]  # two decodes, one prefill
    block_table = torch.tensor([[1, 2], [3, 0], [4, 0]], dtype=torch.int32, device=META)
    query_start_loc = torch.tensor([0, 1, 2, 7], dtype=torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(7, dtype=torch.int64, device=META), block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=query_start_loc,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    torch_metadata = torch_paged.prepare_torch_metadata(metadata, 16, num_kv_heads)
    rows = torch_metadata.decode_rows
    tensors = [rows.query_rows, rows.batch_indices, rows.seq_lens]
    for bucket in torch_metadata.decode_buckets:
        tensors += [bucket.query_rows, bucket.cache_rows, bucket.mask]
    for prefill in torch_metadata.prefills:
        tensors += [prefill.slots] + ([] if prefill.mask is None else [prefill.mask])
    assert {t.device for t in tensors} == {META}
    k_cache = torch.zeros(5, 16, num_kv_heads, head_dim, device=META)
    v_cache = torch.zeros_like(k_cache)
    query = torch.zeros(7, 4, head_dim, device=META)  # fp32: the C kernel must not take it
    out = torch_paged.paged_attention(query, k_cache, v_cache, metadata, 0.3,
                                      torch_metadata=torch_metadata)
    assert out.device == META and out.shape == query.shape
