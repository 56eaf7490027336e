"""SLO-aware prefill budget: how many prompt tokens a step may carry beside running decodes.

With a TPOT target (`--slo-tpot-ms`), an engine that runs decodes and prefills together (the
unified path: a decode instance that prefills locally, or a single engine) sizes each step's
prompt tokens so that no running stream is pushed past its target: the prefill gets what the
streams' slack allows, the decodes are never stalled past their budget. This is Sarathi-Serve's
stall-free batching (Agrawal et al., OSDI '24: a token budget per step derived from the TPOT
SLO), with the budget recomputed every step from the streams' actual slack rather than fixed.

Slack of a stream (`decode_slack`): it has n output tokens since its first token at
`first_token_time`; its target allows `slo_tpot_s * (n - 1 + L)` seconds for the next L tokens
(L = min(tokens it may still generate, LOOKAHEAD_TOKENS)); producing them in decode-only steps
takes `L * t_decode_s`. The slack is the difference minus the time already used. The prompt
part of the next step may take the smallest slack (the step's decode part is one of the L
decode steps already counted). The target is taken at TARGET_FRACTION of `--slo-tpot-ms`.

Both targets: a waiting prompt that can still keep its TTFT target (`--slo-ttft-ms`) but would
not after waiting TTFT_URGENT_FRACTION of it is let through whole, whatever the slack (without
this rule the budget held TPOT and lost on TTFT: docs/benchmarks.md, "Goodput under SLOs").

Early rejection (Mooncake, FAST '25: reject at arrival a request the predicted load would make
miss its SLO, rather than serve it late and slow everyone else): with a TTFT target,
`PrefillBudget.predict_ttft_s` estimates a new prompt's first token from the prompt tokens
queued ahead of it (in the scheduler's admission order), its own uncached tokens and the
fastest cost per token of the engine's recent prompt steps. It ignores the decode steps
interleaved meanwhile, so it is a lower bound: a prompt predicted to miss will miss.
`EngineCore` counts such prompts and, with `--slo-early-reject`, refuses those that the
queue ahead makes miss (`TTFTUnreachableError`: RESOURCE_EXHAUSTED between services, 429 with
Retry-After at the gateway: a retry can succeed); one that would miss even alone is served.
Predictions start once the engine has timed a prompt step of MIN_PREFILL_SAMPLE or more
tokens after its first such step (the first carries one-time costs).

Cost model (`PrefillBudget.observe`): exponential moving averages, over this engine's own
steps, of the decode-only step time and of the seconds per prompt token of steps that carried
at least MIN_PREFILL_SAMPLE prompt tokens (prefill on a CPU is compute bound: its cost is close
to linear in tokens; measured 1.3-1.5 ms per token for SmolLM2-135M fp32 on two cores whether
the chunk is 128 or 2048 tokens).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from pdserve.shared.config import SchedulerConfig
from pdserve.shared.engine.scheduling_policy import admission_order
from pdserve.shared.request import Request, RequestStatus

LOOKAHEAD_TOKENS = 64
"""Tokens ahead a stream's slack looks (its budget for them is granted up front). Short
lookaheads starve prefills into small chunks: with 16, a 512-token prompt went in 16-token
pieces beside every decode step and TPOT p50 doubled (a decode step costs as much as ~20
prompt tokens here, paid again at every chunk)."""
MIN_CHUNK_TOKENS = 256
"""The smallest prompt chunk worth a step beside decodes: a smaller cap schedules none, and
the decode-only steps rebuild the slack (unless the decodes alone miss the target)."""
TTFT_URGENT_FRACTION = 0.6
"""A prompt whose wait plus prefill reaches this fraction of the TTFT target goes now."""
TARGET_FRACTION = 0.9
"""The budget aims at this fraction of the TPOT target (a margin for the estimates)."""
MIN_PREFILL_SAMPLE = 32
"""Steps with fewer prompt tokens do not update the seconds-per-token estimate (noise)."""
EMA_WEIGHT = 0.2
"""Weight of the newest observation in the moving averages."""
PREDICT_WINDOW = 16
"""Prompt steps whose cost per token the TTFT prediction takes the fastest of."""


class TTFTUnreachableError(RuntimeError):
    """A new prompt cannot keep the TTFT target even if it were served at the learned rate
    (raised by `EngineCore.add_request` with `--slo-early-reject`; nothing was queued).

    Attributes:
        predicted_s: the predicted time to first token, seconds since the request's arrival.
        slo_ttft_s: the target, seconds.
    """

    def __init__(self, request_id: str, predicted_s: float, slo_ttft_s: float) -> None:
        super().__init__(f"request {request_id!r} cannot meet the TTFT target: its first token "
                         f"is predicted at {predicted_s:.2f} s (target {slo_ttft_s:.2f} s, "
                         "--slo-early-reject)")
        self.predicted_s = predicted_s
        self.slo_ttft_s = slo_ttft_s


def decode_slack(running: Iterable[Request], slo_tpot_s: float, t_decode_s: float,
                 now: float) -> float:
    """Seconds of extra work a step may add and keep every decoding stream on its target.

    Args:
        running: the engine's running requests; only those past their prompt count.
        slo_tpot_s: the TPOT target, seconds.
        t_decode_s: the expected duration of a decode-only step, seconds.
        now: `time.monotonic()`.

    Returns:
        min over decoding streams of `slo_tpot_s * (n - 1 + L) - (now - start) - L *
        t_decode_s` (see the module docstring; `start` is the first token's time in this
        instance, or the arrival of a stream that came with its first token). inf when no
        stream is decoding. May be negative (a stream already behind).
    """
    slack = float("inf")
    for r in running:
        if r.num_computed_tokens < r.num_prompt_tokens or not r.output_token_ids:
            continue
        start = r.first_token_time if r.first_token_time is not None else r.arrival_time
        max_tokens = r.sampling_params.max_tokens
        left = LOOKAHEAD_TOKENS if max_tokens is None else max(
            0, min(LOOKAHEAD_TOKENS, max_tokens - r.num_output_tokens))
        budget = slo_tpot_s * (r.num_output_tokens - 1 + left)
        slack = min(slack, budget - (now - start) - left * t_decode_s)
    return slack


class PrefillBudget:
    """Per-step cap on prompt tokens for one engine with latency targets, and the TTFT
    prediction of early rejection (module docstring).

    Args:
        slo_tpot_s: the TPOT target, seconds (0: none, `cap` never caps).
        max_num_batched_tokens: the step's token budget (the cap never exceeds it).
        min_prefill_tokens: prompt tokens a step carries beside decodes when the decodes
            alone exceed the target, so that a prefill still progresses (block_size).
        slo_ttft_s: the TTFT target, seconds (0: none). A waiting prompt that can still keep
            it but would not after TTFT_URGENT_FRACTION of it is urgent: the cap lets it
            through whole (`cap`). A prompt that can no longer keep it gets no such favour.
    """

    def __init__(self, slo_tpot_s: float, max_num_batched_tokens: int,
                 min_prefill_tokens: int, slo_ttft_s: float = 0.0) -> None:
        if slo_tpot_s < 0 or slo_ttft_s < 0:
            raise ValueError(f"slo_tpot_s and slo_ttft_s must be >= 0, got {slo_tpot_s}, "
                             f"{slo_ttft_s}")
        self.slo_tpot_s = slo_tpot_s * TARGET_FRACTION
        self.slo_ttft_s = slo_ttft_s
        self.max_num_batched_tokens = max_num_batched_tokens
        self.min_prefill_tokens = min_prefill_tokens
        self.min_chunk_tokens = max(min_prefill_tokens,
                                    min(MIN_CHUNK_TOKENS, max_num_batched_tokens))
        self.t_decode_s = self.slo_tpot_s / 4
        """EMA of decode-only step durations, seconds (a guess until the first one)."""
        self.s_per_token = 0.0
        """EMA of seconds per prompt token (0: no observation yet, no cap)."""
        self.recent_s_per_token: deque[float] = deque(maxlen=PREDICT_WINDOW)
        """Seconds per prompt token of the last PREDICT_WINDOW prompt steps but the engine's
        first (one-time costs: allocations, kernel set-up); `predict_ttft_s` takes the
        fastest, so that its prediction stays a lower bound."""
        self._num_prefill_samples = 0

    def observe(self, step_s: float, num_decode_tokens: int, num_prefill_tokens: int) -> None:
        """Record one step: its wall time (seconds) and its decode and prompt token counts."""
        if num_prefill_tokens == 0:
            if num_decode_tokens:
                self.t_decode_s += EMA_WEIGHT * (step_s - self.t_decode_s)
            return
        if num_prefill_tokens < MIN_PREFILL_SAMPLE:
            return
        per_token = max(0.0, step_s - (self.t_decode_s if num_decode_tokens else 0.0)) \
            / num_prefill_tokens
        self._num_prefill_samples += 1
        if self._num_prefill_samples > 1 and per_token > 0:
            self.recent_s_per_token.append(per_token)
        self.s_per_token = per_token if self.s_per_token == 0 else \
            self.s_per_token + EMA_WEIGHT * (per_token - self.s_per_token)

    def cap(self, running: Iterable[Request], now: float,
            waiting: Iterable[Request] = ()) -> int | None:
        """Prompt tokens the next step may carry; None: no cap (no stream decoding, or no
        cost estimate yet)."""
        if self.s_per_token <= 0 or self.slo_tpot_s <= 0:
            return None
        slack = decode_slack(running, self.slo_tpot_s, self.t_decode_s, now)
        if slack == float("inf"):
            return None
        tokens = int(slack / self.s_per_token) if slack > 0 else 0
        tokens = max(tokens, self.urgent_prompt_tokens(waiting, now))
        if tokens >= self.min_chunk_tokens:
            return min(tokens, self.max_num_batched_tokens)
        if self.t_decode_s < self.slo_tpot_s:
            return 0  # decode-only steps rebuild the slack by slo - t_decode each
        return self.min_prefill_tokens  # the decodes alone miss: prompts still progress

    def urgent_prompt_tokens(self, waiting: Iterable[Request], now: float) -> int:
        """The most prompt tokens left of one waiting prompt whose TTFT target is still
        reachable (its wait plus its prefill at the learned cost fit in `slo_ttft_s`) but
        will not be once it has waited until TTFT_URGENT_FRACTION of it; 0 if none (or no
        TTFT target). Streams with their KV from a prefill instance are not prompts."""
        if self.slo_ttft_s <= 0:
            return 0
        most = 0
        for r in waiting:
            left = r.num_tokens - r.num_computed_tokens
            if r.output_token_ids or left <= 1:
                continue
            done_at = now - r.arrival_time + left * self.s_per_token
            if TTFT_URGENT_FRACTION * self.slo_ttft_s <= done_at <= self.slo_ttft_s:
                most = max(most, left)
        return most

    def predict_ttft_s(self, request: Request, num_cached_tokens: int,
                       waiting: Iterable[Request], running: Iterable[Request],
                       config: SchedulerConfig, now: float) -> float | None:
        """Predicted seconds from `request`'s arrival to its first token, were it queued
        now: its wait so far, plus the prompt tokens left of the running prefills and of the
        waiting prompts admitted before it (`admission_order`), plus its own tokens past
        `num_cached_tokens` (its prefix-cache hit), at the learned seconds per token.
        Streams (requests with output tokens: their KV came from a prefill instance, or
        they were preempted) are decode work and do not count. A lower bound (the
        interleaved decode steps are left out, and the cost per token is the fastest of the
        recent steps). None until a cost is learned (the engine's second prompt step).
        """
        if not self.recent_s_per_token:
            return None
        s_per_token = min(self.recent_s_per_token)
        tokens = max(0, request.num_tokens - max(num_cached_tokens, request.num_computed_tokens))
        for r in running:
            if r.num_computed_tokens < r.num_prompt_tokens:
                tokens += r.num_prompt_tokens - r.num_computed_tokens
        queue = [r for r in waiting if not r.output_token_ids
                 and r.status != RequestStatus.WAITING_FOR_REMOTE_KVS]
        for r in admission_order(queue + [request], config):
            if r is request:
                break
            tokens += r.num_tokens - r.num_computed_tokens
        return now - request.arrival_time + tokens * s_per_token
