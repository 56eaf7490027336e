"""Shared pieces of breakdown.py and kv_memory.py: the workloads' requests (from the
independent harness ../shared/bench/loadgen.py, or benchmarks/workloads.py), the FLOPs of
one token, and an instrumented drive of an offline engine to completion.

`run_engine` adds every request at once and steps `EngineCore` itself (what `LLM.generate`
does), so it can stamp each request's tokens with the time of the step that produced them
(TTFT / ITL at step granularity), time the step's phases (schedule, execute, update) and
call a sampler after every step (`kv_memory.KVSampler`). The phase timers wrap the
engine's own methods on the instance only; nothing in shared/ is changed.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LOADGEN = REPO.parent / "shared" / "bench" / "loadgen.py"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def load_loadgen(path: str | Path | None = None) -> ModuleType:
    """Import ../shared/bench/loadgen.py (not a package) as a module."""
    path = Path(path or DEFAULT_LOADGEN)
    if not path.is_file():
        raise SystemExit(f"loadgen not found at {path} (pass --loadgen)")
    spec = importlib.util.spec_from_file_location("pdserve_bench_loadgen", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True, slots=True)
class WorkRequest:
    prompt: str
    max_tokens: int


def workload_requests(name: str, seed: int, source: str = "loadgen",
                      num_requests: int | None = None, loadgen: str | None = None,
                      reps: int = 5) -> list[WorkRequest]:
    """The requests of `name` for `seed`: loadgen's prompts (default: the ones the full
    stack gets from loadgen.py) or benchmarks/workloads.py's; the first `num_requests`."""
    if source == "loadgen":
        reqs = [WorkRequest(r["prompt"], r["max_tokens"])
                for r in load_loadgen(loadgen).build_workload(name, seed, reps)]
    elif source == "workloads":
        from benchmarks.workloads import build_workload

        reqs = [WorkRequest(r.prompt, r.max_tokens) for r in build_workload(name, seed)]
    else:
        raise ValueError(f"unknown prompt source {source!r} (loadgen, workloads)")
    return reqs[:num_requests] if num_requests else reqs


# -- arithmetic -----------------------------------------------------------------------------

def weight_matrices(model) -> tuple[list, Any]:
    """(every layer's 2-D weights, the LM head weight) of a pdserve.shared.models.llama model.

    Found by shape rather than by name (qkv/o/gate_up/down today), so a renamed or
    re-fused projection is still counted.
    """
    from pdserve.shared.models import weight_layout
    from pdserve.shared.models.layers import Linear

    # NOTE: panel-packed layers hold no plain weight: full_weight() unpacks a copy.
    layer_weights = [m.full_weight() for layer in model.layers for m in layer.modules()
                     if isinstance(m, Linear)]
    return layer_weights, weight_layout.head_weight(model)


def gflop_per_token(model) -> float:
    """2 x (weights of every layer's matmuls + the LM head) / 1e9: ≈0.27 for SmolLM2-135M."""
    layer_weights, lm_head = weight_matrices(model)
    return 2.0 * (sum(w.numel() for w in layer_weights) + lm_head.numel()) / 1e9


# -- statistics -----------------------------------------------------------------------------

def pct(xs: list[float], p: float) -> float | None:
    """Linear-interpolated percentile (loadgen.py's definition)."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def dist_ms(xs: list[float]) -> dict:
    """n / mean / p50 / p90 / p99 / max in milliseconds, as loadgen.py reports them."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "mean": round(statistics.fmean(xs) * 1000, 2),
            **{f"p{p}": round(pct(xs, p) * 1000, 2) for p in (50, 90, 99)},
            "max": round(max(xs) * 1000, 2)}


# -- the instrumented engine loop -----------------------------------------------------------

class StepSampler(Protocol):
    def sample(self, engine, step_s: float) -> None: ...


class _PhaseTimers:
    """Wraps scheduler.schedule / model_runner.execute_model / scheduler.update_from_output
    of one engine instance with perf_counter stamps; `restore()` removes the wrappers."""

    PHASES = ("schedule", "execute", "update")

    def __init__(self, engine) -> None:
        self.engine = engine
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.step_tokens: list[int] = []
        """Tokens scheduled in each non-empty step."""
        self.step_decodes: list[int] = []
        """Single-token sampling rows (decodes) in each non-empty step."""
        sched, runner = engine.scheduler, engine.model_runner
        self._targets = [(sched, "schedule"), (runner, "execute_model"),
                         (sched, "update_from_output")]
        for (obj, attr), phase in zip(self._targets, self.PHASES):
            setattr(obj, attr, self._wrap(getattr(obj, attr), phase))

    def _wrap(self, fn, phase: str):
        seconds = self.seconds

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            seconds[phase] += time.perf_counter() - t0
            if phase == "schedule" and out.scheduled:
                self.step_tokens.append(out.total_num_scheduled_tokens)
                self.step_decodes.append(sum(1 for s in out.scheduled
                                             if s.num_scheduled_tokens == 1 and s.sample))
            return out

        return timed

    def restore(self) -> None:
        for obj, attr in self._targets:
            obj.__dict__.pop(attr, None)


def run_engine(llm, reqs: list[WorkRequest], sampler: StepSampler | None = None,
               tag: str = "bench") -> dict:
    """All of `reqs` added at once to `llm.engine` (greedy, ignore_eos), stepped to the end.

    Returns wall time, token counts, output tok/s, TTFT / ITL / TPOT / e2e (ms, stamped
    when the step that produced the token returned), step counts and phase times.
    Prompts are tokenized before the clock starts (as a server would on arrival).
    """
    from pdserve.shared.request import Request
    from pdserve.shared.sampling_params import SamplingParams

    engine = llm.engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine still has requests")
    prompts = [llm.tokenizer.encode(r.prompt, add_special_tokens=False) for r in reqs]
    requests = [Request(f"{tag}-{i}", ids, SamplingParams(temperature=0, max_tokens=r.max_tokens,
                                                         ignore_eos=True),
                        eos_token_id=llm.eos_token_id)
                for i, (ids, r) in enumerate(zip(prompts, reqs))]
    stamps: dict[str, list[float]] = {r.request_id: [] for r in requests}
    preemptions0 = engine.scheduler.num_preemptions
    hits0 = engine.kv_cache_manager.stats.hits
    timers = _PhaseTimers(engine)
    step_times: list[float] = []
    sampler_s = 0.0
    try:
        t0 = time.perf_counter()
        for r in requests:
            engine.add_request(r)
        while engine.has_unfinished_requests():
            ts = time.perf_counter()
            deltas = engine.step()
            now = time.perf_counter()
            step_times.append(now - ts)
            stamp = now - sampler_s  # the sampler's own time taken out
            for d in deltas:
                if d.new_token_ids:
                    stamps[d.request_id].extend([stamp] * len(d.new_token_ids))
            if sampler is not None:
                sampler.sample(engine, now - ts)
                sampler_s += time.perf_counter() - now
        wall = time.perf_counter() - t0 - sampler_s
    finally:
        timers.restore()
    n_out = sum(len(r.output_token_ids) for r in requests)
    n_in = sum(len(p) for p in prompts)
    ttft = [s[0] - t0 for s in stamps.values() if s]
    itl = [b - a for s in stamps.values() for a, b in zip(s, s[1:])]
    tpot = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps.values() if len(s) > 1]
    e2e = [s[-1] - t0 for s in stamps.values() if s]
    steps = timers.step_tokens
    phases = {k: round(v, 3) for k, v in timers.seconds.items()}
    phases["other"] = round(sum(step_times) - sum(timers.seconds.values()), 3)
    phases["between_steps"] = round(wall - sum(step_times), 3)
    return {
        "requests": len(requests),
        "wall_s": round(wall, 3),
        "prompt_tokens": n_in,
        "output_tokens": n_out,
        "output_tok_per_s": round(n_out / wall, 2),
        "ttft_ms": dist_ms(ttft),
        "itl_ms": dist_ms(itl),
        "tpot_ms": dist_ms(tpot),
        "e2e_ms": dist_ms(e2e),
        "steps": len(steps),
        "steps_decode_only": sum(1 for t, d in zip(steps, timers.step_decodes) if t == d),
        "mean_tokens_per_step": round(statistics.fmean(steps), 1) if steps else 0,
        "mean_decodes_per_step": round(statistics.fmean(timers.step_decodes), 1)
        if steps else 0,
        "scheduled_tokens": sum(steps),
        "phase_s": phases,
        "preemptions": engine.scheduler.num_preemptions - preemptions0,
        "prefix_cache_hit_tokens": engine.kv_cache_manager.stats.hits - hits0,
        "sampler_overhead_s": round(sampler_s, 4),
        "timing": "tokens stamped when their engine step returned; the KV sampler's time is "
                  "taken out of every stamp and of wall_s",
    }
