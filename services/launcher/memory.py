"""Will the plan fit? `pdserve up` refuses at start, in one line, a plan whose processes need
more memory than the machine (or its container) has, instead of being killed by the kernel
mid-run (issue 38): the KV pools are allocated lazily (zero pages), so an oversized
--kv-cache-memory would start and then die under load.

Per engine (prefill or decode replica), before anything is loaded:

    weights   from the checkpoint's safetensors headers (no tensor is read): on the CPU in
              fp32 or bf16 with the panel kernels (AVX-512), 1 x the parameters in that
              dtype, held in the host's weight cache and mapped by every engine
              (`shared.models.weight_cache`), so counted once per host and model, at the
              first engine that maps them (each engine's own with PDSERVE_WEIGHT_CACHE=0);
              without AVX-512, fp32 2 x (the plain weights and their oneDNN-prepacked
              copies); other dtypes 1 x; int8 as fp32
              for each engine (its int8 weights are mapped once per host too, but the bytes
              they save go to each engine's KV pool, `determine_num_gpu_blocks`'
              extra_bytes); on CUDA nothing of the host's.
    kv_cache  --kv-cache-memory (on the CUDA device: nothing of the host's)
    overhead  ENGINE_OVERHEAD_BYTES: the interpreter, torch, kernels and step activations

plus GATEWAY_BYTES for the gateway. SmolLM2-135M fp32 measured 513 MiB of weights held
(`EngineCore.memory_bytes`, mapped); this estimate gives 513 MiB. Not counted: the first
engine's transient peak while it packs the cache file (the checkpoint and the packed copy,
2 x the parameters, for the seconds before it maps the file).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pdserve.services.launcher.plan import Plan
from pdserve.shared.engine_args import EngineArgs, parse_size
from pdserve.shared.models.weight_cache import cache_dir

ENGINE_OVERHEAD_BYTES = 2**30
"""Resident bytes of an engine beyond its weights and KV pool: interpreter, torch, compiled
kernels, the tokenizer, step activations. SmolLM2 in one process after 8 prompts of 500
tokens: RSS 2,215 MiB = 1,134 weights + 256 KV + 825 the rest; rounded up."""
GATEWAY_BYTES = 512 * 2**20
"""Resident bytes of the gateway process (tokenizer, templates, HTTP), a round allowance."""
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ChildMemory:
    name: str
    """The child's name in the plan (prefill-0, decode-1, gateway)."""
    weights: int
    """Weights this child adds to the host: 0 for an engine mapping the weights an earlier
    one of the plan counted (the host's weight cache)."""
    kv_cache: int
    overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.overhead


def checkpoint_numel(model_path: str | Path) -> tuple[int, int]:
    """(parameters, embedding parameters) of a safetensors checkpoint, read from the files'
    headers only. Raises OSError / ValueError for a missing or unreadable file."""
    import json
    import math
    import struct

    total = embedding = 0
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            numel = math.prod(info["shape"])
            total += numel
            if name.endswith("embed_tokens.weight"):
                embedding = numel
    return total, embedding


def has_panel_kernels() -> bool:
    """The CPU has AVX-512 and the panel kernels are not switched off (`kernels.cpu_gemv`;
    read here without importing torch)."""
    if "0" in (os.environ.get("PDSERVE_CPU_GEMV"), os.environ.get("PDSERVE_PACKED_LINEAR")):
        return False
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


def engine_weight_bytes(model_path: str, dtype: str, device: str,
                        quantization: str = "none") -> tuple[int, bool]:
    """(host bytes of an engine's weights as it holds them, whether engines of the host share
    them), see the module's docstring. `dtype` as --dtype takes it: vLLM's aliases and
    "auto" resolve as the engine resolves them (`EngineArgs.resolve_dtype`: float ->
    float32, half -> float16, auto on CPU -> float32)."""
    if device != "cpu":
        return 0, False
    dtype = EngineArgs(model=model_path, dtype=dtype, device=device).resolve_dtype({})
    params, _ = checkpoint_numel(model_path)
    if quantization != "none":
        return params * 4, False
    panels = has_panel_kernels() and dtype in ("float32", "bfloat16")
    if panels:
        return params * _DTYPE_BYTES[dtype], cache_dir() is not None
    if dtype != "float32":
        return params * _DTYPE_BYTES.get(dtype, 4), False
    return 2 * params * 4, False


def _flag(argv: tuple[str, ...], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv[:-1] else default


def plan_memory(plan: Plan) -> list[ChildMemory]:
    """Each engine's and the gateway's estimate (Redis: negligible, not listed)."""
    out = []
    weights_of: dict[tuple[str, str, str, str], tuple[int, bool]] = {}
    for child in plan.children:
        argv = child.argv
        if "serve" in argv and any(role in argv for role in ("prefill", "decode")):
            device = _flag(argv, "--device", "cpu")
            quantization = _flag(argv, "--quantization",
                                 os.environ.get("PDSERVE_QUANTIZATION", "none"))
            key = (_flag(argv, "--model", ""), _flag(argv, "--dtype", "auto"), device,
                   quantization)
            mapped_already = key in weights_of and weights_of[key][1]
            if key not in weights_of:
                weights_of[key] = engine_weight_bytes(*key)
            weights = 0 if mapped_already else weights_of[key][0]
            kv = parse_size(_flag(argv, "--kv-cache-memory", "2GiB")) if device == "cpu" else 0
            out.append(ChildMemory(child.name, weights, kv, ENGINE_OVERHEAD_BYTES))
        elif child.name.startswith("gateway"):
            out.append(ChildMemory(child.name, 0, 0, GATEWAY_BYTES))
    return out


def machine_memory() -> int:
    """Bytes of memory this process may use: the physical memory, or its cgroup's limit
    (a container's) when lower."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def check_plan_fits(plan: Plan, memory: int | None = None) -> str | None:
    """None when the plan's estimate fits `memory` (default: `machine_memory()`), else the
    one-line refusal naming the need, what it is made of and what to lower."""
    children = plan_memory(plan)
    need = sum(c.total for c in children)
    memory = machine_memory() if memory is None else memory
    if need <= memory:
        return None
    engines = [c for c in children if c.name != "gateway"]
    gib = 2 ** 30
    parts = ", ".join(
        f"{c.name} {c.total / gib:.1f} GiB (weights {c.weights / gib:.1f} + KV "
        f"{c.kv_cache / gib:.1f} + runtime {c.overhead / gib:.1f})" for c in engines[:4])
    if len(engines) > 4:
        parts += f", ... ({len(engines)} engines)"
    return (f"this plan needs about {need / gib:.1f} GiB of memory but the machine has "
            f"{memory / gib:.1f} GiB: {parts}; lower --kv-cache-memory or the number of "
            "replicas (--num-prefill / --num-decode)")
