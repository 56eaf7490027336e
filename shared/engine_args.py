"""EngineArgs: the engine's command-line flags (vLLM spellings) and PDSERVE_* variables,
resolved once into the frozen configs of `shared.config`.

Precedence: command-line flag > PDSERVE_<FLAG> environment variable > default.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
from dataclasses import dataclass

from pdserve.shared.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdserve.shared.engine.spec_decode.config import SpeculativeConfig, check_draft_model
from pdserve.shared.kv_cache.tier_args import add_kv_tier_cli_args
from pdserve.shared.lora.args import LoRAConfig, add_lora_cli_args, create_lora_config
from pdserve.shared.pooling_params import PoolerConfig, resolve_runner

logger = logging.getLogger(__name__)


def parse_size(text: str | int) -> int:
    """'4GiB', '512M', '1.5G', '1073741824' -> bytes, > 0. Raises ValueError (also for zero,
    negative, infinite or NaN sizes)."""
    if isinstance(text, int):
        value = float(text)
    else:
        s = str(text).strip().upper().removesuffix("B").removesuffix("I")
        mult = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
        try:
            value = float(s[:-1]) * mult[s[-1]] if s and s[-1] in mult else float(s)
        except ValueError:
            raise ValueError(
                f"kv_cache_memory: cannot read size {text!r} (e.g. 2GiB, 512MiB)") from None
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"kv_cache_memory: {text!r} is not a size in bytes > 0 "
                         "(e.g. 2GiB, 512MiB)")
    return int(value)


def parse_cores(text: str) -> tuple[int, ...]:
    """'0-1', '0,2,3' -> (0, 1) / (0, 2, 3)."""
    cores: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "-" in part:
            a, b = part.split("-", 1)
            cores.extend(range(int(a), int(b) + 1))
        else:
            cores.append(int(part))
    return tuple(cores)


@dataclass
class EngineArgs:
    model: str = "SmolLM2-135M-Instruct"
    served_model_name: str | None = None
    dtype: str = "float32"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: str = "2GiB"
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    device: str = "cpu"
    cpu_cores: str = ""
    num_threads: int = 0
    attention_backend: str = "auto"
    core_share: str = ""
    scheduling_policy: str = "sjf"
    burst_gap_ms: float = 4.0
    max_decode_stall_ms: float = 0.0
    trace_file: str = ""
    slo_ttft_ms: float = 0.0
    """Latency target for the first token (DistServe's TTFT SLO); 0: none. Bounds how long
    an engine yields its turn on the core share (a quarter of it)."""
    slo_tpot_ms: float = 0.0
    """Latency target per output token (DistServe's TPOT SLO); 0: none."""
    slo_early_reject: bool = False
    """With --slo-ttft-ms: refuse (429) a prompt predicted at arrival to miss it."""
    quantization: str = "none"
    seed: int | None = None
    speculative_config: str | dict | None = None
    """JSON (or a dict, offline) as vLLM's --speculative-config; used by the decode role."""
    # vLLM's flags that a `vllm serve` command line carries; accepted so that it runs here.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    trust_remote_code: bool = False
    enforce_eager: bool = False
    """CUDA: True runs every step eagerly; False (vLLM's default) captures the decode step
    as CUDA graphs. No effect on CPU (no graphs there)."""
    cuda_graph_sizes: list[int] | str | None = None
    """Decode batch sizes to capture (vLLM's --cuda-graph-sizes); None: 1, 2, 4, then every
    multiple of 8 up to max_num_seqs."""
    disable_log_requests: bool = False
    runner: str = "auto"
    """vLLM's --runner: auto (generate, or pooling with --convert embed), generate, pooling."""
    convert: str = "auto"
    """vLLM's --convert: embed serves the decoder as an embedding model (--runner pooling)."""
    pooler_config: str | dict | None = None
    """vLLM's --pooler-config JSON: {"pooling_type": "LAST" | "MEAN" | "CLS",
    "normalize": bool} (default LAST, normalised)."""
    override_pooler_config: str | dict | None = None
    """vLLM's older spelling of --pooler-config (its keys win)."""
    enable_lora: bool = False
    """Multi-LoRA serving (shared/lora/args.py has the LoRA flags)."""
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    kv_offload_dir: str = ""
    """The disk tier's directory (shared/kv_cache/tier_args.py); empty: no disk tier."""
    kv_offload_size: str = "8GiB"
    kv_events_config: str | dict | None = None
    """vLLM's --kv-events-config JSON (services/common/kv_events.py); None: no publisher."""

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        d = EngineArgs()

        def env(name: str, default):
            return os.environ.get("PDSERVE_" + name.upper(), default)

        def env_bool(name: str, default: bool) -> bool:
            v = os.environ.get("PDSERVE_" + name.upper())
            return default if v is None else v.lower() in ("1", "true", "yes", "on")

        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=env("model", d.model),
                       help="HF directory, .gguf file, or SmolLM2-135M-Instruct (default)")
        g.add_argument("--served-model-name", default=env("served_model_name", None))
        g.add_argument("--dtype", default=env("dtype", d.dtype),
                       choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
                       help="auto: bfloat16 on CPUs with AVX512-BF16 (else float32), the "
                            "model's 16-bit dtype on CUDA; float = float32, half = float16 "
                            "(as vLLM)")
        g.add_argument("--max-model-len", type=int, default=env("max_model_len", None))
        g.add_argument("--block-size", type=int, default=int(env("block_size", d.block_size)))
        g.add_argument("--kv-cache-memory", default=env("kv_cache_memory", d.kv_cache_memory),
                       help="bytes for the KV pool, e.g. 2GiB")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=env_bool("enable_prefix_caching", d.enable_prefix_caching))
        g.add_argument("--num-gpu-blocks-override", type=int,
                       default=env("num_gpu_blocks_override", None))
        g.add_argument("--max-num-seqs", type=int,
                       default=int(env("max_num_seqs", d.max_num_seqs)))
        g.add_argument("--max-num-batched-tokens", type=int,
                       default=int(env("max_num_batched_tokens", d.max_num_batched_tokens)))
        g.add_argument("--long-prefill-token-threshold", type=int,
                       default=int(env("long_prefill_token_threshold",
                                       d.long_prefill_token_threshold)),
                       help="cap each step's chunk of one prompt at this many tokens (vLLM's "
                            "flag; 0: no cap): bounds how long a prefill step holds the cores")
        g.add_argument("--scheduling-policy", default=env("scheduling_policy",
                                                          d.scheduling_policy),
                       choices=["sjf", "fcfs", "priority"],
                       help="waiting requests: shortest prompt first (with a 10 s aging "
                            "bound) or arrival order")
        g.add_argument("--burst-gap-ms", type=float,
                       default=float(env("burst_gap_ms", d.burst_gap_ms)),
                       help="an idle engine that gets a request keeps taking arrivals until "
                            "none comes for this long (at most 10x), then orders the burst; "
                            "0: step at once")
        g.add_argument("--quantization", default=env("quantization", d.quantization),
                       choices=["none", "int8"],
                       help="int8: linear layers, LM head and embeddings in int8 (symmetric "
                            "per output channel, fp32 activations; CPU only); "
                            "prefill and decode must use the same")
        g.add_argument("--device", default=env("device", d.device), choices=["cpu", "cuda"])
        v = parser.add_argument_group("vLLM command-line compatibility")
        v.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="only 1 (one device per engine; scale out with more instances)")
        v.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                       help="only 1")
        v.add_argument("--gpu-memory-utilization", type=float, default=None,
                       help="accepted and ignored: --kv-cache-memory sizes the KV pool")
        v.add_argument("--trust-remote-code", action="store_true",
                       help="accepted; no effect (Llama-family models load without code)")
        g.add_argument("--enforce-eager", action="store_true",
                       default=env_bool("enforce_eager", d.enforce_eager),
                       help="CUDA: run every step eagerly instead of replaying the decode "
                            "step from CUDA graphs (captured at start-up); no effect on CPU")
        # NOTE: strings, parsed by resolve_cuda_graph_sizes: argparse would run type=int over
        # the variable's whole "4 8" default.
        g.add_argument("--cuda-graph-sizes", nargs="+",
                       default=env("cuda_graph_sizes", None),
                       help="CUDA: decode batch sizes to capture as graphs (a step of n "
                            "requests replays the smallest size >= n; larger steps run "
                            "eagerly); default 1 2 4 8 16 ... up to --max-num-seqs")
        v.add_argument("--disable-log-requests", action="store_true",
                       help="accepted; no effect (requests are not logged one by one)")
        g.add_argument("--seed", type=int, default=env("seed", None),
                       help="seeds the sampler's generator of requests without a seed of "
                            "their own (default: random)")
        g.add_argument("--speculative-config", default=env("speculative_config", None),
                       help='speculative decoding on the decode role, JSON as vLLM: '
                            '{"method": "ngram", "num_speculative_tokens": 3, '
                            '"prompt_lookup_max": 5, "prompt_lookup_min": 2} or '
                            '{"method": "draft_model", "model": DIR, '
                            '"num_speculative_tokens": 4} '
                            '(default: off; see docs/speculative-decoding.md)')
        g.add_argument("--runner", default=env("runner", d.runner),
                       choices=["auto", "generate", "pooling"],
                       help="pooling: serve the model as an embedding model (prefill only: "
                            "/v1/embeddings, /pooling, /score, /rerank); auto: generate "
                            "unless --convert embed")
        g.add_argument("--convert", default=env("convert", d.convert),
                       choices=["auto", "none", "embed"],
                       help="embed: a decoder checkpoint as an embedding model (implies "
                            "--runner pooling)")
        g.add_argument("--pooler-config", default=env("pooler_config", None),
                       help='the pooler, JSON as vLLM: {"pooling_type": "LAST" | "MEAN" | '
                            '"CLS", "normalize": true} (default: LAST, L2-normalised)')
        g.add_argument("--override-pooler-config", default=env("override_pooler_config", None),
                       help="vLLM's older spelling of --pooler-config")
        g.add_argument("--cpu-cores", default=env("cpu_cores", d.cpu_cores),
                       help="cores to bind to, e.g. 0-1")
        g.add_argument("--num-threads", type=int, default=int(env("num_threads", 0)))
        g.add_argument("--attention-backend", default=env("attention_backend", "auto"),
                       choices=["auto", "torch", "triton"])
        g.add_argument("--core-share", default=env("core_share", d.core_share),
                       help="host-local core-share board file shared by the engines of one "
                            "host (each step takes its share of the cores among the busy "
                            "engines); `pdserve up` passes one; empty: fixed thread count")
        g.add_argument("--max-decode-stall-ms", type=float,
                       default=float(env("max_decode_stall_ms", d.max_decode_stall_ms)),
                       help="core share: if > 0, a decode-only engine lets a busy prefill "
                            "engine of the host have the cores until its streams have waited "
                            "this long; 0 (default): decodes never wait for prefills")
        g.add_argument("--slo-ttft-ms", type=float,
                       default=float(env("slo_ttft_ms", d.slo_ttft_ms)),
                       help="time-to-first-token target (ms; 0: none): an engine waits at "
                            "most a quarter of it for the host's other engines")
        g.add_argument("--slo-tpot-ms", type=float,
                       default=float(env("slo_tpot_ms", d.slo_tpot_ms)),
                       help="time-per-output-token target (ms; 0: none): with a core share, "
                            "a decode engine lets the host's prefill engine have every core "
                            "while its streams have slack")
        g.add_argument("--slo-early-reject", action="store_true",
                       default=env_bool("slo_early_reject", d.slo_early_reject),
                       help="with --slo-ttft-ms: refuse (429, Retry-After) a prompt predicted "
                            "at arrival to miss the TTFT target (Mooncake's early rejection); "
                            "off: it is served, counted in pdserve_slo_ttft_unreachable")
        add_lora_cli_args(g, env, env_bool)
        add_kv_tier_cli_args(g, env)
        g.add_argument("--trace-file", default=env("trace_file", d.trace_file),
                       help="append this engine's timeline (steps, core-share waits, KV "
                            "transfers) to this Chrome-trace file, for Perfetto; every engine "
                            "of a host may name the same file")
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names and v is not None})

    def resolve_dtype(self, hf_config: dict) -> str:
        """--dtype as ModelConfig takes it: vLLM's aliases (float, half) and "auto" (CPU:
        `kernels.cpu_features.resolve_cpu_dtype`, which also refuses bf16 without AVX512-BF16;
        CUDA: the checkpoint's bfloat16 / float16, else float16)."""
        from pdserve.kernels import cpu_features

        alias = {"float": "float32", "half": "float16"}
        if self.device == "cpu":
            return cpu_features.resolve_cpu_dtype(alias.get(self.dtype, self.dtype))
        if self.dtype != "auto":
            return alias.get(self.dtype, self.dtype)
        # NOTE: transformers 5 writes "dtype" where 4.x wrote "torch_dtype".
        torch_dtype = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "")
        return torch_dtype if torch_dtype in ("bfloat16", "float16") else "float16"

    def resolve_cuda_graph_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes to capture: none on CPU or with --enforce-eager or another
        attention backend than Triton; else --cuda-graph-sizes (a list, or a string of
        numbers split by spaces or commas) capped at max_num_seqs, or vLLM's default list.

        Raises:
            ValueError: a size that is not a positive integer.
        """
        if self.device != "cuda" or self.enforce_eager or self.attention_backend == "torch":
            return ()
        from pdserve.shared.engine.cuda_graph import default_capture_sizes

        sizes = self.cuda_graph_sizes
        if sizes is None:
            return default_capture_sizes(self.max_num_seqs)
        if not isinstance(sizes, str):
            sizes = " ".join(str(s) for s in sizes)
        sizes = sizes.replace(",", " ").split()
        try:
            parsed = sorted({int(s) for s in sizes})
        except ValueError:
            raise ValueError(f"cuda_graph_sizes must be integers, got {sizes!r}") from None
        if not parsed or parsed[0] < 1:
            raise ValueError(f"cuda_graph_sizes must be positive integers, got {sizes!r}")
        return tuple(s for s in parsed if s <= self.max_num_seqs) or (self.max_num_seqs,)

    def create_lora_config(self) -> LoRAConfig | None:
        """The LoRAConfig (None without --enable-lora). Raises ValueError naming the flag."""
        return create_lora_config(self.enable_lora, self.max_loras, self.max_lora_rank,
                                  self.max_cpu_loras)

    def create_speculative_config(self) -> SpeculativeConfig | None:
        """The parsed --speculative-config; None when off. Raises ValueError naming the key."""
        return SpeculativeConfig.from_value(self.speculative_config)

    def create_engine_configs(self) -> tuple[ModelConfig, CacheConfig, SchedulerConfig,
                                             ParallelConfig]:
        """Resolve every "auto" and the model path, validate, and freeze.

        Raises:
            ValueError / FileNotFoundError: naming the flag that is wrong.
        """
        from pdserve.shared.models.architectures import check_hf_config
        from pdserve.shared.models.convert import resolve_model_path
        from pdserve.shared.models.loader import read_hf_config

        model_path = resolve_model_path(self.model)
        hf = read_hf_config(model_path)
        max_pos = int(hf.get("max_position_embeddings", 2048))
        max_model_len = self.max_model_len or min(max_pos, 8192)
        if max_model_len > max_pos:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_pos}")
        check_hf_config(hf, max_model_len)
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) != 1:
                raise ValueError(f"{name}={getattr(self, name)}: pdserve runs one device per "
                                 "engine; scale out with more prefill / decode instances")
        if self.gpu_memory_utilization is not None:
            logger.warning("--gpu-memory-utilization is ignored: --kv-cache-memory (%s) sizes "
                           "the KV pool", self.kv_cache_memory)
        dtype = self.resolve_dtype(hf)
        runner = resolve_runner(self.runner, self.convert)
        if self.quantization not in ("none", "int8"):
            raise ValueError(f"quantization must be 'none' or 'int8', got {self.quantization!r}")
        if self.quantization == "int8" and (self.device != "cpu" or dtype != "float32"):
            raise ValueError("quantization int8 needs --device cpu and --dtype float32, got "
                             f"{self.device} {dtype}")
        for name in ("long_prefill_token_threshold", "max_decode_stall_ms", "burst_gap_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.slo_ttft_ms < 0 or self.slo_tpot_ms < 0:
            raise ValueError("slo_ttft_ms and slo_tpot_ms must be >= 0 (0: no target)")
        if self.slo_early_reject and self.slo_ttft_ms <= 0:
            raise ValueError("--slo-early-reject needs a TTFT target (--slo-ttft-ms)")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.block_size < 16 and (self.device == "cuda" or self.attention_backend == "triton"):
            raise ValueError(f"block_size must be at least 16 for the Triton kernels "
                             f"(--device cuda), got {self.block_size}")
        name = self.served_model_name or (
            self.model if os.sep not in self.model else os.path.basename(str(model_path)))
        model_config = ModelConfig(model=self.model, model_path=str(model_path),
                                   served_model_name=name, dtype=dtype,  # type: ignore
                                   max_model_len=max_model_len,
                                   vocab_size=int(hf["vocab_size"]),
                                   quantization=self.quantization,  # type: ignore[arg-type]
                                   seed=None if self.seed is None else int(self.seed),
                                   runner=runner,  # type: ignore[arg-type]
                                   pooler_config=None if runner == "generate" else
                                   PoolerConfig.from_flags(self.pooler_config,
                                                           self.override_pooler_config))
        speculative_config = self.create_speculative_config()
        if speculative_config is not None:
            check_draft_model(speculative_config, model_config.vocab_size, max_model_len)
        cache_config = CacheConfig(block_size=self.block_size,
                                   kv_cache_memory=parse_size(self.kv_cache_memory),
                                   enable_prefix_caching=self.enable_prefix_caching,
                                   num_gpu_blocks_override=self.num_gpu_blocks_override,
                                   kv_offload_dir=self.kv_offload_dir,
                                   kv_offload_size=parse_size(self.kv_offload_size))
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max(self.max_num_batched_tokens, self.block_size),
            max_model_len=max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            scheduling_policy=self.scheduling_policy,  # type: ignore[arg-type]
            burst_gap_s=self.burst_gap_ms / 1000.0)
        parallel_config = ParallelConfig(device=self.device,  # type: ignore[arg-type]
                                         cuda_graph_sizes=self.resolve_cuda_graph_sizes(),
                                         num_threads=self.num_threads,
                                         cpu_cores=parse_cores(self.cpu_cores),
                                         attention_backend=self.attention_backend,  # type: ignore
                                         core_share=self.core_share,
                                         max_decode_stall_s=self.max_decode_stall_ms / 1000.0,
                                         max_yield_s=(self.slo_ttft_ms / 4000.0
                                                      if self.slo_ttft_ms > 0 else 0.5),
                                         slo_ttft_s=self.slo_ttft_ms / 1000.0,
                                         slo_tpot_s=self.slo_tpot_ms / 1000.0,
                                         slo_early_reject=self.slo_early_reject,
                                         trace_file=self.trace_file)
        logger.info("config: %s %s %s %s", model_config, cache_config, scheduler_config,
                    parallel_config)
        return model_config, cache_config, scheduler_config, parallel_config
