"""Frozen engine configuration: one small dataclass per concern, built once, passed down."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from pdserve.shared.pooling_params import PoolerConfig

DEFAULT_MAX_CHUNK_BYTES = (4 << 20) - (64 << 10)
"""Largest KV payload per KVChunk: under gRPC's default 4 MiB with room for the header."""
GRPC_MESSAGE_HEADROOM = 1 << 20
"""Bytes above the KV payload: a KVChunk's header, and any other message (a Prefill or
Generate request of a 200k-token prompt is ~0.8 MiB of token ids and block hashes)."""
MAX_GRPC_MESSAGE_BYTES = DEFAULT_MAX_CHUNK_BYTES + GRPC_MESSAGE_HEADROOM
"""gRPC max send and receive message size of every server and channel between the gateway,
prefill and decode (~4.9 MiB): the KV chunk cap plus headroom; larger messages are refused
with RESOURCE_EXHAUSTED before they are buffered."""

GRPC_KEEPALIVE_S = float(os.environ.get("PDSERVE_GRPC_KEEPALIVE_S", "10"))
"""Seconds between HTTP/2 keepalive pings on every internal channel (gateway -> prefill and
decode, decode -> prefill FetchKV), read once at import (tests set 1). A peer that stops
answering (frozen, partitioned) fails its calls with UNAVAILABLE after about
GRPC_KEEPALIVE_S + GRPC_KEEPALIVE_TIMEOUT_S instead of hanging until the call's deadline."""
GRPC_KEEPALIVE_TIMEOUT_S = min(5.0, 2 * GRPC_KEEPALIVE_S)
"""Seconds a keepalive ping waits for its ack before the connection is closed."""


def grpc_keepalive_channel_options(keepalive_s: float | None = None) -> list[tuple[str, int]]:
    """gRPC channel options: a keepalive ping every `keepalive_s` seconds (default
    GRPC_KEEPALIVE_S), also on an idle connection, timing out after min(5, 2 * keepalive_s)."""
    if keepalive_s is None:
        keepalive_s, timeout_s = GRPC_KEEPALIVE_S, GRPC_KEEPALIVE_TIMEOUT_S
    else:
        timeout_s = min(5.0, 2 * keepalive_s)
    return [("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
            # NOTE: grpcio 1.85 arms a keepalive ping's timer with this one (default 60 s),
            # not with keepalive_timeout_ms: without it a frozen peer is found after 60 s.
            ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]


GRPC_RECONNECT_BACKOFF_MS = (250, 2000)
"""Initial and largest wait (ms) between a channel's reconnect attempts (gRPC's defaults are
1 s growing to 120 s): an instance back after a restart or a network cut is reached again
within about 2 s."""


def grpc_reconnect_options() -> list[tuple[str, int]]:
    """gRPC channel options: reconnect backoff GRPC_RECONNECT_BACKOFF_MS."""
    initial_ms, max_ms = GRPC_RECONNECT_BACKOFF_MS
    return [("grpc.initial_reconnect_backoff_ms", initial_ms),
            ("grpc.max_reconnect_backoff_ms", max_ms)]


SERVER_KEEPALIVE_S = min(GRPC_KEEPALIVE_S, 2.0)
"""Seconds between the servers' own keepalive pings to their clients (the gateway, a decode
fetching KV): a client that stops answering (frozen, gone without a FIN) has its streams
cancelled, so their requests are aborted and their KV blocks freed, within about
SERVER_KEEPALIVE_S + SERVER_KEEPALIVE_TIMEOUT_S (6 s by default) instead of at their
deadline."""
SERVER_KEEPALIVE_TIMEOUT_S = min(GRPC_KEEPALIVE_TIMEOUT_S, 2 * SERVER_KEEPALIVE_S)
"""Seconds a server's keepalive ping waits for its ack before the connection is closed."""


def grpc_keepalive_server_options() -> list[tuple[str, int]]:
    """gRPC server options: ping every client every SERVER_KEEPALIVE_S seconds, and accept
    clients' pings, also on idle connections, as often as every min(1, GRPC_KEEPALIVE_S) s
    (half that, for timer jitter) instead of answering GOAWAY too_many_pings: clients with
    any interval of 1 s or more are fine, whatever this process's own setting."""
    min_interval_ms = int(min(1.0, GRPC_KEEPALIVE_S) * 500)
    return [("grpc.keepalive_permit_without_calls", 1),
            # GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS in grpc_types.h
            ("grpc.http2.min_ping_interval_without_data_ms", min_interval_ms),
            ("grpc.keepalive_time_ms", int(SERVER_KEEPALIVE_S * 1000)),
            ("grpc.keepalive_timeout_ms", int(SERVER_KEEPALIVE_TIMEOUT_S * 1000)),
            ("grpc.http2.ping_timeout_ms", int(SERVER_KEEPALIVE_TIMEOUT_S * 1000)),
            ("grpc.http2.max_pings_without_data", 0)]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str
    """The `--model` value as given (name, HF directory or .gguf path)."""
    model_path: str
    """Resolved local HF directory holding config.json and safetensors."""
    served_model_name: str
    """The name clients use (OpenAI `model` field); also a prefix-hash extra key."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and KV dtype. fp32 is the exact default; bfloat16 on CPU needs AVX512-BF16
    (`EngineArgs.resolve_dtype`), and runs the VDPBF16PS panels (`kernels.cpu_gemv`)."""
    max_model_len: int = 2048
    """Prompt + generated tokens, at most the model's max_position_embeddings."""
    vocab_size: int = 0
    """From the HF config; token ids outside [0, vocab_size) are rejected."""
    quantization: Literal["none", "int8"] = "none"
    """"int8": linear layers, LM head and embeddings quantized at load, symmetric per output
    channel (`kernels.cpu_int8`); KV stays `dtype`. Prefill and decode must agree: the KV
    handle carries it and it enters the prefix-cache block hashes."""
    seed: int | None = None
    """Seeds the sampler's generator of requests without a seed (--seed); None: random."""
    runner: Literal["generate", "pooling"] = "generate"
    """vLLM's --runner: "pooling" serves the decoder as an embedding model (prefill only,
    shared/pooling_params.py); "generate" samples tokens."""
    pooler_config: PoolerConfig | None = None
    """The pooler of a pooling runner (None: generate)."""


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block (a power of two)."""
    kv_cache_memory: int = 2 << 30
    """Bytes for the paged KV pool (all layers, K and V); sets num_gpu_blocks."""
    enable_prefix_caching: bool = True
    """Automatic prefix caching (APC) of full blocks."""
    num_gpu_blocks_override: int | None = None
    """Testing knob: exact pool size, null block included."""
    kv_offload_dir: str = ""
    """The disk tier's directory (blocks evicted from the pool kept as files); "": none."""
    kv_offload_size: int = 8 << 30
    """Most bytes the disk tier holds (least recently used blocks dropped first)."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    """Most requests RUNNING at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decode tokens + prefill chunks)."""
    max_model_len: int = 2048
    """Same as ModelConfig.max_model_len; copied so the scheduler needs no ModelConfig."""
    long_prefill_token_threshold: int = 0
    """If > 0, a prefill chunk is capped at this many tokens per step."""
    scheduling_policy: Literal["sjf", "fcfs", "priority"] = "sjf"
    """Which waiting request is admitted next. "sjf": the one with the fewest tokens left
    to compute (shortest job first: a burst's median request gets its first token after the
    short prompts, not after half of all prompt tokens), except that requests waiting longer
    than `max_wait_s` go first, oldest first, so no long prompt starves; "fcfs": arrival
    order. Preempted requests resume before either. "priority" (vLLM's): by the requests'
    `priority` (lower first), then arrival, preempted ones included; the running requests
    are kept in that order, so a preemption takes the lowest priority, newest first."""
    max_wait_s: float = 10.0
    """"sjf": seconds after which a waiting request is admitted in arrival order."""
    burst_gap_s: float = 0.004
    """Online serving (`AsyncEngine`): when a request reaches an idle engine, the engine keeps
    taking arrivals before its first step until none has come for this long (at most 10x
    this in all), so that a burst is ordered as a whole (shortest first) rather than
    starting with whichever request happened to arrive first. 0: step at once. After vLLM
    v0's `scheduler_delay_factor` and Triton's dynamic-batching `max_queue_delay`.
    A single request pays at most one gap in TTFT."""


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's flags; shared/lora/). An engine without one (None) has no
    LoRA layers: the base model's forward is unchanged."""

    max_loras: int = 1
    """Adapters one step can serve (--max-loras): the slots of the stacked LoRA weights; a
    waiting request of another adapter waits for a slot."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted (--max-lora-rank, at most 64)."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in memory, least recently used evicted first (--max-cpu-loras,
    at least max_loras); None: max_loras."""


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    device: Literal["cpu", "cuda"] = "cpu"
    num_threads: int = 0
    """torch intra-op threads; 0 means len(cpu_cores) or torch's default."""
    cpu_cores: tuple[int, ...] = ()
    """Core ids this process binds to (sched_setaffinity); empty means no binding."""
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    """auto: triton on CUDA, the torch implementation on CPU."""
    cuda_graph_sizes: tuple[int, ...] = ()
    """Decode batch sizes captured as CUDA graphs at start-up (`shared/engine/cuda_graph.py`);
    empty: every step runs eagerly (on CPU, or with --enforce-eager)."""
    core_share: str = ""
    """Path of the host's core-share board (`shared/engine/core_share.py`): the engines of
    one host size their thread pools, step by step, to their share of the cores among those
    busy now; empty means a fixed thread count."""
    max_decode_stall_s: float = 0.0
    """Core share only: if > 0, an engine with only decodes to run lets a busy prefill engine
    of its host have the cores, until its streams have waited this long since its last step;
    then it takes one step on every core (the wait grows by the rest of the prefill
    engine's step in progress). 0 (default): decodes never wait for prefills, the cores are
    split between them. Measured on mixed64 (docs/benchmarks.md), 0.5 s gave TTFT p90 0.84x
    but output tok/s 0.92x, TPOT p50 1.23x and ITL p99 3x. See `shared/engine/core_share.py`."""
    max_yield_s: float = 0.5
    """Core share only: the longest this engine waits, with work to do, for other engines of
    its host (a shorter prefill, a due decode); then it publishes itself overdue and takes its
    next step. Derived from the TTFT target (`--slo-ttft-ms` / 4) when one is given, so two
    stacks sharing a host never starve each other."""
    slo_ttft_s: float = 0.0
    """The TTFT target (0: none): with `slo_tpot_s`, a prompt that must start now to keep it
    is not held back by the decodes' prefill budget (`shared/engine/slo_budget.py`)."""
    slo_early_reject: bool = False
    """With `slo_ttft_s`: refuse at arrival a prompt predicted to miss it (Mooncake's early
    rejection; 429 at the gateway) instead of serving it late. Off: such prompts are served
    and counted (`pdserve_slo_ttft_unreachable`)."""
    slo_tpot_s: float = 0.0
    """Core share only: the TPOT target of this engine's streams (0: none). With one, an
    engine with only decodes lets a busy prefill engine of its host have every core while
    each stream keeps more than `tpot_reserve_s` of slack (`min_tpot_slack`); below that
    the engines split the cores."""
    tpot_reserve_s: float = 0.0
    """The slack a decode engine keeps in reserve before it yields; 0: 2 x slo_tpot_s."""
    trace_file: str = ""
    """Opt-in timeline (`shared/engine/trace.py`): the engine appends its steps, its waits on
    the core share and its KV transfers to this Chrome-trace file; empty: no timeline."""
