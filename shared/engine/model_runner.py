"""ModelRunner: turns a SchedulerOutput into model inputs, runs the model, samples.

Owns the model weights and the paged KV cache tensors of one engine process.
"""

from __future__ import annotations

import contextlib
import logging
from typing import NamedTuple

import numpy as np
import torch

from pdserve.kernels.attn_metadata import AttentionMetadata, build_attn_metadata
from pdserve.kernels.cpu_native import load_native_kernel
from pdserve.shared.config import CacheConfig, LoRAConfig, ModelConfig, ParallelConfig
from pdserve.shared.engine.attention import PagedAttention
from pdserve.shared.engine.cuda_graph import CUDAGraphRunner
from pdserve.shared.engine.model_runner_output import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    ModelRunnerOutput,
)
from pdserve.shared.engine.pooler import has_pooling, pool_step
from pdserve.shared.engine.prompt_logprobs import (
    PromptLogprobsJob,
    compute_prompt_logprobs,
    plan_prompt_logprobs,
)
from pdserve.shared.engine.sampler import Sampler, SamplingMetadata
from pdserve.shared.engine.spec_decode.verification import (
    DraftRows,
    expand_draft_rows,
    group_draft_samples,
)
from pdserve.shared.lora.model_manager import LoRAModelManager
from pdserve.shared.models.llama import LlamaArgs
from pdserve.shared.models.loader import load_model
from pdserve.shared.models.rotary import LongRows
from pdserve.shared.request import Request
from pdserve.shared.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_cache_bytes_per_block(args: LlamaArgs, block_size: int, dtype: str) -> int:
    """Bytes one block takes over all layers, K and V."""
    return (2 * args.num_hidden_layers * block_size * args.num_kv_heads * args.head_dim
            * _DTYPE_BYTES[dtype])


def determine_num_gpu_blocks(args: LlamaArgs, cache_config: CacheConfig, dtype: str,
                             extra_bytes: int = 0) -> int:
    """Blocks (null block included) that fit the `kv_cache_memory` budget plus `extra_bytes`
    (the weight memory `--quantization` saved).

    Raises:
        ValueError: the budget holds fewer than 2 blocks.
    """
    if cache_config.num_gpu_blocks_override is not None:
        return cache_config.num_gpu_blocks_override
    per_block = kv_cache_bytes_per_block(args, cache_config.block_size, dtype)
    num_blocks = (cache_config.kv_cache_memory + extra_bytes) // per_block
    if num_blocks < 2:
        raise ValueError(f"kv_cache_memory={cache_config.kv_cache_memory} bytes holds "
                         f"{num_blocks} blocks of {per_block} bytes; need at least 2")
    return int(num_blocks)


class PreparedInputs(NamedTuple):
    input_ids: torch.Tensor
    positions: torch.Tensor
    """[num_tokens] int64: each token's position, its row of the rotary tables (a longrope
    request's tokens below the original length: their long rows, `use_long_rows`)."""
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    """[num_sampled] int64: the batch row of each request's last token that samples."""
    sampled_requests: list[Request]
    """The requests that sample this step, in batch order (one per `logits_indices` entry
    without drafts)."""
    prompt_logprobs_jobs: list[PromptLogprobsJob]
    """Prompt positions whose logprobs this step computes (requests asking for them)."""
    draft_rows: DraftRows | None = None
    """With speculative drafts in the step: the logits rows (one per scored position,
    `logits_indices` then holds one index per row); None otherwise."""


class ModelRunner:
    long_rows: LongRows | None = None
    """longrope: where the rows of `Request.rope_long` tokens are; None: no such rows."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 parallel_config: ParallelConfig,
                 structured_output: StructuredOutputManager,
                 lora_config: LoRAConfig | None = None) -> None:
        """`structured_output` masks guided rows' logits and advances their grammars;
        `lora_config` (None: no LoRA) adds LoRA layers to the model (shared/lora/)."""
        self.structured_output = structured_output
        self.device = torch.device(parallel_config.device)
        self.dtype = _DTYPES[model_config.dtype]
        self.block_size = cache_config.block_size
        self.model = load_model(model_config.model_path, model_config.dtype, parallel_config.device,
                                model_config.quantization)
        self.args = self.model.args
        self.lora_manager = (LoRAModelManager(self.model, lora_config, self.device)
                             if lora_config is not None else None)
        """The adapters and the LoRA layers' slots; None: LoRA off (plain linears)."""
        self.long_rows = self.model.rotary.long_rows
        self.num_gpu_blocks = determine_num_gpu_blocks(self.args, cache_config,
                                                       model_config.dtype,
                                                       self.model.weight_bytes_saved)
        shape = (self.num_gpu_blocks, self.block_size, self.args.num_kv_heads,
                 self.args.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.args.num_hidden_layers)
        ]
        backend = parallel_config.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.attention_backend = backend
        self.prefill_rows = backend == "torch" and self.device.type == "cpu" \
            and self.dtype == torch.bfloat16 and load_native_kernel(
                self.args.head_dim, self.args.num_kv_heads,
                self.args.num_heads // self.args.num_kv_heads, self.dtype) is not None
        """bf16 on CPU: prompt tokens attend as rows of the C kernel (`PagedAttention`)."""
        self.sampler = Sampler(seed=model_config.seed)
        self.pooling_states: dict[str, torch.Tensor] = {}
        """Pooling requests' state between prompt chunks (shared/engine/pooler.py)."""
        self.cuda_graph_runner: CUDAGraphRunner | None = None
        """Replays pure-decode steps from CUDA graphs; None: every step runs eagerly."""
        # NOTE: the torch backend's per-step host indices cannot be captured, nor can the
        # LoRA layers' per-step segments: with LoRA every step runs eagerly.
        if (parallel_config.cuda_graph_sizes and self.device.type == "cuda"
                and backend == "triton" and lora_config is None):
            self.cuda_graph_runner = CUDAGraphRunner(
                self.model, self.kv_caches, self.block_size, self.args.num_kv_heads,
                model_config.max_model_len, parallel_config.cuda_graph_sizes, self.device,
                backend)
            self.cuda_graph_runner.capture()
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB), attention backend %s",
                    self.num_gpu_blocks, self.block_size,
                    self.num_gpu_blocks * kv_cache_bytes_per_block(
                        self.args, self.block_size, model_config.dtype) / 2**20, backend)
        logger.info("memory held on %s: %s", self.device.type, ", ".join(
            f"{kind} {n / 2**20:.1f} MiB" for kind, n in self.memory_bytes().items()))

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this runner holds, by kind: the model's weights as loaded ("weights"), their
        packed copies ("packed_weights") and int8 forms ("int8_weights") (the model's
        `weight_bytes_by_kind`), and the KV pool ("kv_cache": every layer's K and V, on
        `device`). Activations are not counted: they come and go with each step."""
        kinds = self.model.weight_bytes_by_kind()
        kinds["kv_cache"] = sum(t.numel() * t.element_size()
                                for pair in self.kv_caches for t in pair)
        return kinds

    def prepare_inputs(self, scheduled: list) -> PreparedInputs:
        """Flatten the scheduled requests (`ScheduledRequest`s, in batch order) into one batch;
        tests/shared/engine/test_prepare_inputs_golden.py works an example through."""
        num_reqs = len(scheduled)
        q_lens = np.fromiter((s.num_scheduled_tokens for s in scheduled), np.int64, num_reqs)
        starts = np.fromiter((s.start_pos for s in scheduled), np.int64, num_reqs)
        verify_reqs = frozenset(i for i, s in enumerate(scheduled) if s.spec_token_ids)
        meta, positions, query_start_loc = build_attn_metadata(
            starts, q_lens, [s.block_ids for s in scheduled], self.block_size, self.device,
            verify_reqs)
        if self.long_rows is not None:
            use_long_rows(positions, scheduled, query_start_loc, self.long_rows)
        input_ids = np.empty(int(query_start_loc[-1]), np.int64)
        for i, s in enumerate(scheduled):
            a, n = query_start_loc[i], s.num_scheduled_tokens
            if n == 1:
                input_ids[a] = s.request.token_at(s.start_pos)
            elif s.spec_token_ids:  # the last known token, then the drafts
                input_ids[a] = s.request.token_at(s.start_pos)
                input_ids[a + 1:a + n] = s.spec_token_ids
            else:
                input_ids[a:a + n] = s.request.token_slice(s.start_pos, s.start_pos + n)
        sampled = [i for i, s in enumerate(scheduled) if s.sample
                   and s.request.pooling_params is None]  # pooling: see pooler.py
        logits_indices = query_start_loc[1:][sampled] - 1
        draft_rows = None
        if verify_reqs:
            logits_indices, draft_rows = expand_draft_rows(scheduled, sampled, query_start_loc)
        return PreparedInputs(
            input_ids=torch.from_numpy(input_ids).to(self.device),
            positions=positions,
            attn_metadata=meta,
            logits_indices=torch.from_numpy(logits_indices).to(self.device),
            sampled_requests=[scheduled[i].request for i in sampled],
            prompt_logprobs_jobs=plan_prompt_logprobs(scheduled, query_start_loc),
            draft_rows=draft_rows,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """The decoder over one step's tokens: [num_tokens] ids and positions ->
        [num_tokens, hidden_size], replayed from a CUDA graph when one fits the step."""
        graphs = self.cuda_graph_runner
        batch = graphs.bucket(attn_metadata, input_ids.shape[0]) if graphs else None
        if batch is not None:
            return graphs.run(input_ids, positions, attn_metadata, batch)
        attn = PagedAttention(attn_metadata, self.attention_backend, self.block_size,
                              self.args.num_kv_heads, prefill_rows=self.prefill_rows)
        return self.model(input_ids, positions, self.kv_caches, attn)

    @torch.inference_mode()
    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        """Run one step: the samples of the requests that sample (their drafts' included)
        and the prompt logprobs of the scheduled prompt positions of requests asking for
        them (shared/engine/prompt_logprobs.py), the pooled vectors of pooling requests
        whose prompt it completes (shared/engine/pooler.py). Writes into no request."""
        for request_id in scheduler_output.finished_request_ids:  # aborted mid-prompt
            self.pooling_states.pop(request_id, None)
        if not scheduler_output.scheduled:
            return EMPTY_MODEL_RUNNER_OUTPUT
        inputs = self.prepare_inputs(scheduler_output.scheduled)
        with (self.lora_manager.step(scheduler_output.scheduled) if self.lora_manager
              else contextlib.nullcontext()):
            hidden = self.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        pooler_output = (pool_step(self.model.norm, hidden, scheduler_output.scheduled,
                                   self.pooling_states)
                         if has_pooling(scheduler_output.scheduled) else {})
        prompt_logprobs = (compute_prompt_logprobs(self.model.compute_logits, hidden,
                                                   inputs.prompt_logprobs_jobs)
                           if inputs.prompt_logprobs_jobs else {})
        if not inputs.sampled_requests:
            return ModelRunnerOutput([], [], [], prompt_logprobs, pooler_output)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        rows, draft_rows = inputs.sampled_requests, inputs.draft_rows
        if draft_rows is not None:
            rows = draft_rows.requests
        self.structured_output.apply_bitmask(logits, rows)
        metadata = SamplingMetadata.from_requests(
            rows, self.args.vocab_size, self.device,
            draft_rows.output_offsets if draft_rows is not None else None)
        out = self.sampler(logits, metadata)
        self.structured_output.accept_tokens(rows, out.sampled_token_ids)
        if draft_rows is not None:
            sampled_token_ids, logprobs = group_draft_samples(draft_rows, out.sampled_token_ids,
                                                              out.logprobs)
        else:
            sampled_token_ids = [[token_id] for token_id in out.sampled_token_ids]
            logprobs = [[lp] for lp in out.logprobs]
        return ModelRunnerOutput([r.request_id for r in inputs.sampled_requests],
                                 sampled_token_ids, logprobs, prompt_logprobs, pooler_output)


def use_long_rows(positions: torch.Tensor, scheduled: list, query_start_loc: np.ndarray,
                  long_rows: LongRows) -> None:
    """In place: the tokens of each `rope_long` request below the original length read their
    long rows (shared/models/rope_scaling.py); from it on, a position's row is long already.
    Only a long request's chunks that start below it have such tokens (never a decode)."""
    original, offset = long_rows
    for i, s in enumerate(scheduled):
        if s.request.rope_long and s.start_pos < original:
            first = int(query_start_loc[i])
            positions[first:first + min(s.num_scheduled_tokens, original - s.start_pos)] += offset
