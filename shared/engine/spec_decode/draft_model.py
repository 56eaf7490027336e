"""DraftModelProposer: a smaller model with the target's tokenizer drafts k tokens greedily,
over a paged KV cache of its own (the project's model code and attention, a second pool).

Per step, for the requests that speculate (after the target's step has appended their
accepted tokens):

    1. sync      roll each request's draft KV back to the longest prefix equal to its
                 tokens (rejected drafts drop out; `DraftKVCache.sync`)
    2. catch up  one forward over every request's tokens not yet in the draft cache (the
                 whole prompt on first use: the prefill service ships only the target's
                 KV), sampling d_0 at each request's last token
    3. draft     k - 1 forwards of one token per request (d_{j-1} fed at position T+j-1,
                 d_j sampled), every speculating request batched in each

Drafts are the draft model's argmax: a deterministic (one-hot) proposal, so the target's
verification (`verification.py`) keeps greedy outputs identical and temperature sampling
distributed exactly as without speculation.

Source: Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"; vLLM's draft-model proposer (vllm/v1/spec_decode/).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
import torch

from pdserve.kernels.attn_metadata import build_attn_metadata
from pdserve.shared.config import ModelConfig
from pdserve.shared.engine.attention import PagedAttention
from pdserve.shared.engine.spec_decode.config import SpeculativeConfig, check_draft_model
from pdserve.shared.engine.spec_decode.draft_kv import DraftKVCache
from pdserve.shared.models.loader import load_model
from pdserve.shared.request import Request

logger = logging.getLogger(__name__)


class DraftRow(NamedTuple):
    """One request's query tokens in a draft forward."""

    request_id: str
    block_ids: list[int]
    start_pos: int
    """Position of the first fed token (= draft KV computed before this forward)."""
    token_ids: list[int]


class DraftModelProposer:
    """Loads the draft beside the target and proposes for a batch of requests.

    Args:
        config: `method == "draft_model"`; `model` names the draft.
        model_config: the target's (dtype, quantization and max_model_len are shared).
        model_runner: the target's ModelRunner (device, block size, attention backend,
            vocabulary and pool size).

    Raises:
        ValueError: the draft's vocabulary size differs from the target's, or its
            max_position_embeddings is below max_model_len.
    """

    def __init__(self, config: SpeculativeConfig, model_config: ModelConfig,
                 model_runner) -> None:
        from pdserve.shared.engine.model_runner import kv_cache_bytes_per_block
        from pdserve.shared.models.convert import resolve_model_path

        assert config.model is not None
        self.k = config.num_speculative_tokens
        check_draft_model(config, model_runner.args.vocab_size, model_config.max_model_len)
        path = resolve_model_path(config.model)
        self.model = load_model(path, model_config.dtype, model_runner.device.type,
                                model_config.quantization)
        self.args = self.model.args
        self.device = model_runner.device
        self.block_size = model_runner.block_size
        self.attention_backend = model_runner.attention_backend
        per_block = kv_cache_bytes_per_block(self.args, self.block_size, model_config.dtype)
        if config.draft_kv_cache_memory is None:
            num_blocks = model_runner.num_gpu_blocks  # every running request's KV fits
        else:
            num_blocks = config.draft_kv_cache_memory // per_block
            if num_blocks < 2:
                raise ValueError(f"speculative_config.draft_kv_cache_memory holds "
                                 f"{num_blocks} blocks of {per_block} bytes; need at least 2")
        self.kv = DraftKVCache(num_blocks, self.block_size)
        shape = (num_blocks, self.block_size, self.args.num_kv_heads, self.args.head_dim)
        dtype = model_runner.dtype
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=self.device),
                           torch.zeros(shape, dtype=dtype, device=self.device))
                          for _ in range(self.args.num_hidden_layers)]
        logger.info("draft model %s: %d layers, KV cache %d blocks x %d tokens (%.1f MiB)",
                    path, self.args.num_hidden_layers, num_blocks, self.block_size,
                    num_blocks * per_block / 2**20)

    @torch.inference_mode()
    def propose_requests(self, requests: list[Request], max_num_drafts: list[int]
                         ) -> list[list[int]]:
        """Up to min(k, max_num_drafts[i]) greedy drafts per request; [] for a request
        whose draft KV does not fit the draft's pool this step."""
        drafts: dict[str, list[int]] = {}
        num_drafts: dict[str, int] = {}
        rows: list[DraftRow] = []
        for request, limit in zip(requests, max_num_drafts):
            n = min(self.k, limit)
            if n <= 0:
                continue
            request_id, num_tokens = request.request_id, request.num_tokens
            # NOTE: at least the last token is fed: its logits give d_0.
            start = self.kv.sync(request)
            if start >= num_tokens:
                start = num_tokens - 1
                self.kv.truncate(request_id, start)
            # KV for positions [0, T + n - 1): the known tokens and d_0 .. d_{n-2}.
            block_ids = self.kv.allocate(request_id, num_tokens + n - 1)
            if block_ids is None:
                continue  # the draft's pool is full: no drafts for it this step
            rows.append(DraftRow(request_id, block_ids, start,
                                 request.token_slice(start, num_tokens)))
            drafts[request_id], num_drafts[request_id] = [], n
        for j in range(self.k):
            if not rows:
                break
            for row, token_id in zip(rows, self._forward(rows)):
                self.kv.append_tokens(row.request_id, row.token_ids, confirmed=j == 0)
                drafts[row.request_id].append(token_id)
            rows = [DraftRow(r.request_id, r.block_ids, r.start_pos + len(r.token_ids),
                             [drafts[r.request_id][-1]])
                    for r in rows if len(drafts[r.request_id]) < num_drafts[r.request_id]]
        return [drafts.get(r.request_id, []) for r in requests]

    def remove_requests(self, request_ids: list[str]) -> None:
        """Free the draft KV of finished, aborted or preempted requests (a preempted one
        catches up again when it next speculates)."""
        for request_id in request_ids:
            self.kv.free(request_id)

    def _forward(self, rows: list[DraftRow]) -> list[int]:
        """One draft forward over `rows`; the argmax token after each row's last token."""
        q_lens = np.fromiter((len(r.token_ids) for r in rows), np.int64, len(rows))
        starts = np.fromiter((r.start_pos for r in rows), np.int64, len(rows))
        meta, positions, query_start_loc = build_attn_metadata(
            starts, q_lens, [r.block_ids for r in rows], self.block_size, self.device)
        input_ids = np.fromiter((t for r in rows for t in r.token_ids), np.int64,
                                int(query_start_loc[-1]))
        attn = PagedAttention(meta, self.attention_backend, self.block_size,
                              self.args.num_kv_heads)
        hidden = self.model(torch.from_numpy(input_ids).to(self.device), positions,
                            self.kv_caches, attn)
        last = torch.from_numpy(query_start_loc[1:] - 1).to(self.device)
        return self.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
