"""Request: one sequence's state inside an engine core (torch-free).

Lifecycle (vLLM v1's `RequestStatus` order; everything after PREEMPTED is finished):

    WAITING ──schedule──▶ RUNNING ──stop/length/abort──▶ FINISHED_*
       ▲                     │
       └──── PREEMPTED ◀─────┘   (blocks freed, num_computed_tokens reset: recompute)

    WAITING_FOR_REMOTE_KVS ──KV written by the transfer──▶ WAITING/RUNNING   (decode role)

    WAITING / RUNNING / PREEMPTED ──pause──▶ PAUSED ──resume──▶ WAITING / PREEMPTED
                                             (keeps its blocks until preempted; see
                                              shared/engine/scheduler_pause.py)

A prefill finished for a remote decode keeps its blocks until the KV connector says its
transfer is done (docs/lifecycle.md).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.shared.kv_cache.prefix_hash import BlockHash, BlockHasher
from pdserve.shared.kv_transfer.params import HeldBlocks, RemoteDecode, RemotePrefill
from pdserve.shared.lora.request import LoRARequest
from pdserve.shared.pooling_params import PoolingParams
from pdserve.shared.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PAUSED = enum.auto()
    PREEMPTED = enum.auto()
    # NOTE: every status after PREEMPTED is a finished one (see is_finished).
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


class FinishReason(str, enum.Enum):
    """The OpenAI-facing finish reason."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities for one sampled token (fp32 log-softmax of the raw logits)."""

    token_id: int
    logprob: float
    top_token_ids: list[int]
    """The `logprobs` most likely token ids, most likely first."""
    top_logprobs: list[float]
    rank: int | None = None
    """vLLM's `Logprob.rank` of `token_id`: how many vocabulary tokens have a logprob >= its
    own (1 = the most likely); set for prompt logprobs, None where not computed."""


@dataclass(slots=True, eq=False)
class Request:
    """One sequence: prompt, generated tokens, and how much of it has KV in this instance."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    cache_salt: str | None = None
    """Tenant salt mixed into the first block's hash (prefix-cache isolation)."""
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose KV is written in this instance's cache."""
    num_cached_tokens: int = -1
    """Tokens not computed here, recorded at first admission (-1 until then): prefix-cache
    hits plus `num_external_computed_tokens`."""
    num_external_computed_tokens: int = 0
    """Tokens whose KV a transfer wrote (vLLM's name; WAITING_FOR_REMOTE_KVS requests)."""
    num_preemptions: int = 0
    rope_long: bool = False
    """longrope: its KV is (to be) computed with the long factors, as transformers rotates a
    sequence longer than original_max_position_embeddings; set by the scheduler, by the
    decode service for a received prompt that long (shared/models/rope_scaling.py)."""
    stop_reason: int | None = None
    """The stop token id that finished the request, if any."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With `sampling_params.prompt_logprobs`: one entry per prompt token, entry 0 None,
    filled as the prompt is computed (`add_prompt_logprobs`, by the scheduler from the model
    runner's output; shared/engine/prompt_logprobs.py)."""
    prompt_logprobs_sent: bool = False
    """The scheduler handed `prompt_logprobs` out (with the first output)."""
    structured_output: Any = None
    """A guided request's grammar matcher (shared/structured_output/request.py), set when
    the engine adds it; None for an unguided request."""
    block_hasher: BlockHasher | None = None
    """The engine's hasher (`prefix_hash.request_block_hasher`), handed at creation or when
    the engine adds it (`set_block_hasher`); None: not hashed (yet)."""
    block_hashes: list[BlockHash] = field(default_factory=list)
    """Chained hashes of its full blocks (vLLM's `Request.block_hashes`): every full block of
    its known tokens once it has a `block_hasher`, extended as tokens append, so each block
    is hashed once per engine. The KV cache manager and the KV handle read them."""
    kv_transfer_params: RemoteDecode | RemotePrefill | HeldBlocks | None = None
    """KV transfer (shared/kv_transfer/params.py), as vLLM's: set by the service,
    `RemoteDecode` asks that a prefill's blocks wait for a decode instance (once finished,
    `HeldBlocks` when the scheduler holds them, None when they were freed); `RemotePrefill`
    says a decode's prompt KV arrives from a prefill instance."""
    first_token_time: float | None = None
    """Monotonic time this instance sampled the first output token (None: not yet, or the
    request arrived with it, from a prefill instance: then `arrival_time` is that moment)."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens proposed to follow the known tokens, scored by the next step
    (speculative decoding, shared/engine/spec_decode/); empty without speculation."""
    pooling_params: PoolingParams | None = None
    """A pooling (embedding) request: prefill only, finished with `pooled` instead of a
    token (shared/pooling_params.py); None: a generate request."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter it runs under (shared/lora/); None: the base model. Its name enters
    the first block's hash, so its KV is never served to another adapter or the base."""

    def __post_init__(self) -> None:
        self.update_block_hashes()

    def set_block_hasher(self, block_hasher: BlockHasher) -> None:
        """Hash its full blocks with `block_hasher`, now and as tokens append."""
        self.block_hasher = block_hasher
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Hash the full blocks not hashed yet (none without a `block_hasher`)."""
        if self.block_hasher is not None:
            self.block_hashes.extend(self.block_hasher(self))

    def set_rope_long(self) -> None:
        """Compute its KV with longrope's long factors from now on: its blocks hash apart
        from short ones (`prefix_hash.block_extra_keys`), so they are hashed again."""
        self.rope_long = True
        self.block_hashes = []
        self.update_block_hashes()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building all_token_ids."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def append_output_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        if not self.output_token_ids and self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        self.update_block_hashes()

    def add_prompt_logprobs(self, first_pos: int, logprobs: list[TokenLogprobs]) -> None:
        """Record the prompt logprobs of positions first_pos + 1 on (`prompt_logprobs` is
        created by the step that starts the prompt at position 0)."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * self.num_prompt_tokens
        self.prompt_logprobs[first_pos + 1:first_pos + 1 + len(logprobs)] = logprobs

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self.status)
