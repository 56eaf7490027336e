"""--quantization int8 beside fp32 pdserve in one run: output tok/s of the `single` and
`mixed64` workloads (in-process engines, alternating rounds, medians), resident weight memory,
the kernel comparison behind the int8 kernel, perplexity and greedy agreement; llama.cpp's
single-stream tok/s beside them when a llama-cpp-python wheel installs (never built here).

    .venv/bin/python benchmarks/quantization.py [--rounds 3] [--threads 2] [--skip kernels,quality]

Prints a JSON summary. This machine is shared and noisy: quote the ratios, re-run alone.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.workloads import build_workload  # noqa: E402
from pdserve.shared.llm import LLM  # noqa: E402
from pdserve.shared.sampling_params import SamplingParams  # noqa: E402

TEXT = ROOT / "tests" / "data" / "declaration_gettysburg.txt"
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down


def run_workload(llm: LLM, reqs) -> float:
    """Output tokens per second of `reqs`, all submitted at once (`single`: one at a time)."""
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in reqs]
    t0 = time.perf_counter()
    n_out = 0
    if len(reqs) <= 5:  # `single`: sequential requests
        for r, p in zip(reqs, params):
            n_out += len(llm.generate(r.prompt, p)[0].outputs[0].token_ids)
    else:
        n_out = sum(len(o.outputs[0].token_ids)
                    for o in llm.generate([r.prompt for r in reqs], params))
    return n_out / (time.perf_counter() - t0)


def speed(llms: dict[str, LLM], rounds: int, mixed_requests: int) -> dict:
    workloads = {"single": build_workload("single"),
                 "mixed64": build_workload("mixed64")[:mixed_requests]}
    for llm in llms.values():  # warm-up: first-call allocations, kernel builds
        run_workload(llm, workloads["single"][:1])
    samples: dict[str, dict[str, list[float]]] = {w: {m: [] for m in llms} for w in workloads}
    for r in range(rounds):
        for w, reqs in workloads.items():
            order = list(llms) if r % 2 == 0 else list(reversed(llms))  # alternate who's first
            for mode in order:
                samples[w][mode].append(run_workload(llms[mode], reqs))
    out = {}
    for w, by_mode in samples.items():
        med = {m: statistics.median(v) for m, v in by_mode.items()}
        out[w] = {"output_tok_per_s": {m: round(v, 2) for m, v in med.items()},
                  "samples": {m: [round(x, 2) for x in v] for m, v in by_mode.items()},
                  "ratio_int8_vs_fp32": round(med["int8"] / med["fp32"], 3)}
    return out


def memory(llms: dict[str, LLM]) -> dict:
    m32, m8 = (llms[m].engine.model_runner.model for m in ("fp32", "int8"))
    fp32_params = m32.parameter_bytes()
    return {"fp32_parameter_bytes": fp32_params,
            "fp32_engine_resident_bytes": m32.resident_weight_bytes(),
            "int8_engine_resident_bytes": m8.resident_weight_bytes(),
            "ratio_vs_fp32_parameters": round(m8.resident_weight_bytes() / fp32_params, 3),
            "ratio_vs_fp32_engine": round(m8.resident_weight_bytes()
                                          / m32.resident_weight_bytes(), 3),
            "kv_blocks": {m: llm.engine.num_gpu_blocks for m, llm in llms.items()}}


def quality(llms: dict[str, LLM]) -> dict:
    from pdserve.shared.tokenizer import apply_chat_template
    from tests.conftest import PARITY_MESSAGES  # the 8 parity prompts

    tok = llms["fp32"].tokenizer
    ids = tok.encode(TEXT.read_text(), add_special_tokens=False)
    ppl = {}
    for mode, llm in llms.items():
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(
            temperature=0, max_tokens=1, prompt_logprobs=0))[0]
        lps = [p.logprob for p in out.prompt_logprobs[1:]]
        ppl[mode] = math.exp(-sum(lps) / len(lps))
    greedy = SamplingParams(temperature=0, max_tokens=64)
    prompts = [{"prompt_token_ids": apply_chat_template(tok, m)} for m in PARITY_MESSAGES]
    ref, got = ([o.outputs[0].token_ids for o in llms[m].generate(prompts, greedy)]
                for m in ("fp32", "int8"))
    agree = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), min(len(r), len(g)))
             for r, g in zip(ref, got)]
    return {"text_tokens": len(ids), "perplexity": {m: round(v, 4) for m, v in ppl.items()},
            "perplexity_ratio": round(ppl["int8"] / ppl["fp32"], 4),
            "greedy_tokens_before_first_divergence": agree,
            "fp32_output_lengths": [len(r) for r in ref]}


def kernels(threads: int) -> dict:
    """The 30 layers' four matmuls (distinct weights, as a step reads them) at several batch
    sizes: fp32 oneDNN-prepacked, the weight-only int8 C kernel, the VNNI kernel with int8
    (W8A8) and 16-bit (W8A16) activations where it builds, fbgemm dynamic int8, int8pack_mm
    bf16."""
    from pdserve.kernels import cpu_int8, cpu_linear

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) * 0.05 for _ in range(30) for n, k in LAYER_SHAPES]
    packed = [cpu_linear.pack_weight(w) for w in weights]
    w8 = [cpu_int8.quantize_linear(w) for w in weights]
    w8a8 = [cpu_int8.quantize_linear(w, w8a8=True) for w in weights]
    w8a16 = [cpu_int8.quantize_linear(w, a16=True) for w in weights]
    rows = [cpu_int8.quantize_weight(w) for w in weights]  # [N, K] int8, scale [N]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.backends.quantized.engine = "fbgemm"
        fbgemm = [torch.ops.quantized.linear_prepack(torch._make_per_channel_quantized_tensor(
            q, s.double(), torch.zeros(len(s), dtype=torch.long), 0), None) for q, s in rows]
    bf16 = [(q, s.to(torch.bfloat16)) for q, s in rows]
    del weights

    def timed(fn) -> float:
        fn()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return round(statistics.median(ts) * 1e3, 2)

    out = {}
    for m in (1, 4, 16, 64, 256, 2048):
        xs = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
        x = [xs[k] for _ in range(30) for _, k in LAYER_SHAPES]
        row = {"fp32_onednn_ms": timed(lambda x=x: [cpu_linear.linear(a, p)
                                                for a, p in zip(x, packed)]),
               "int8_c_ms": timed(lambda x=x: [cpu_int8.linear(a, q) for a, q in zip(x, w8)]),
               "int8_w8a8_ms": timed(lambda x=x: [cpu_int8.linear(a, q)
                                                  for a, q in zip(x, w8a8)]),
               "int8_w8a16_ms": timed(lambda x=x: [cpu_int8.linear(a, q)
                                                   for a, q in zip(x, w8a16)]),
               "fbgemm_dynamic_ms": timed(lambda x=x: [torch.ops.quantized.linear_dynamic(a, p)
                                                   for a, p in zip(x, fbgemm)])}
        if m <= 16:
            row["int8pack_mm_bf16_ms"] = timed(lambda x=x: [torch._weight_int8pack_mm(
                a.to(torch.bfloat16), q, s).float() for a, (q, s) in zip(x, bf16)])
        out[f"M={m}"] = row
    return out


def llama_cpp(threads: int, rounds: int) -> dict:
    """llama.cpp's single-stream tok/s, median of `rounds` (llama-cpp-python in its own venv
    under /tmp), on the GGUF pdserve converts from, EOS banned as pdserve's ignore_eos.
    Installed on first use: pip builds it from source where no wheel fits (about 7 minutes
    on 2 cores); an install that fails is reported, not fatal."""
    venv = Path("/tmp/pdserve-llama-cpp-venv")
    python = venv / "bin" / "python"
    installed = python.exists() and subprocess.run(
        [str(python), "-c", "import llama_cpp"], capture_output=True, check=False).returncode == 0
    if not installed:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        print("llama_cpp: installing llama-cpp-python (a source build where no wheel fits)",
              file=sys.stderr, flush=True)
        built = subprocess.run([str(python), "-m", "pip", "install", "llama-cpp-python"],
                               capture_output=True, text=True, check=False)
        if built.returncode != 0:
            return {"skipped": "llama-cpp-python did not install: " + built.stderr[-300:]}
    from pdserve.shared.models.convert import find_smollm2_gguf

    script = f"""
import json, statistics, time, llama_cpp, sys
sys.path.insert(0, {str(ROOT)!r})
from benchmarks.workloads import build_workload
llm = llama_cpp.Llama({str(find_smollm2_gguf())!r}, n_threads={threads}, n_ctx=2048,
                      verbose=False)
llm("Hello", max_tokens=4)  # warm-up
samples = []
for _ in range({rounds}):
    n, t = 0, 0.0
    for r in build_workload("single"):
        t0 = time.perf_counter()
        out = llm(r.prompt, max_tokens=r.max_tokens, temperature=0.0, repeat_penalty=1.0,
                  logit_bias={{llm.token_eos(): -1e9}})
        t += time.perf_counter() - t0
        n += out["usage"]["completion_tokens"]
    samples.append(n / t)
print(json.dumps({{"output_tok_per_s": round(statistics.median(samples), 2),
                  "samples": [round(x, 2) for x in samples]}}))
"""
    done = subprocess.run([str(python), "-c", script], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        return {"error": done.stderr[-500:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mixed-requests", type=int, default=64,
                    help="the first N requests of mixed64 (a shorter check)")
    ap.add_argument("--skip", default="", help="comma list of: speed, kernels, quality, "
                                                "llama_cpp")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    torch.set_num_threads(args.threads)
    report: dict = {"threads": args.threads, "rounds": args.rounds}
    if "kernels" not in skip:
        report["kernels"] = kernels(args.threads)
    common = dict(kv_cache_memory="2GiB", num_threads=args.threads)
    llms = {"fp32": LLM(args.model, **common),
            "int8": LLM(args.model, quantization="int8", **common)}
    report["memory"] = memory(llms)
    if "quality" not in skip:
        report["quality"] = quality(llms)
    if "speed" not in skip:
        report["speed"] = speed(llms, args.rounds, args.mixed_requests)
    if "llama_cpp" not in skip:
        report["llama_cpp_single"] = llama_cpp(args.threads, args.rounds)
        single = report.get("speed", {}).get("single", {}).get("output_tok_per_s", {})
        theirs = report["llama_cpp_single"].get("output_tok_per_s")
        if theirs and single:
            report["llama_cpp_single"]["ratio_int8_vs_llama_cpp"] = round(
                single["int8"] / theirs, 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
