"""Scheduling policy, the scheduler's pure parts: who may enter (`validate_request`), in what
order (`admission_order`), and the next prefill's size for the host's core share
(`prefill_urgency`). None of them touch the KV cache or the scheduler's queues; `Scheduler`
and `EngineCore` call them. When a request stops: shared/stop_rules.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

from pdserve.shared.config import SchedulerConfig
from pdserve.shared.engine.core_share import NO_PREFILL
from pdserve.shared.request import Request, RequestStatus

DECODE_LIKE_TOKENS = 16
"""A waiting request with output tokens and at most this many tokens left to compute (a
stream whose prompt KV arrived from a prefill instance: 1 token) is decode work for the core
share, not a prefill: counting it as the host's shortest prefill made the prefill engine
park, and the decode wait for that engine's step to end, at every admission."""


def window_chunk_config(config: SchedulerConfig, sliding_window: int | None,
                        block_size: int, num_gpu_blocks: int) -> SchedulerConfig:
    """`config`, with prompt chunks small enough that one chunk plus a window fits the pool
    when the KV cache manager frees out-of-window blocks (every layer windowed): then a
    request holds at most `window_blocks_held` blocks however long it is, so a prompt longer
    than the pool is served chunk by chunk instead of refused. Unchanged otherwise."""
    if sliding_window is None:
        return config
    window_blocks = -(-(sliding_window - 1) // block_size) + 1
    cap = max(block_size, (num_gpu_blocks - 1 - window_blocks) * block_size)
    threshold = config.long_prefill_token_threshold
    if cap >= config.max_num_batched_tokens or (0 < threshold <= cap):
        return config
    return dataclasses.replace(config, long_prefill_token_threshold=cap)


def window_blocks_held(sliding_window: int, block_size: int, max_chunk_tokens: int) -> int:
    """The most blocks a request holds at once when out-of-window blocks are freed: the
    window's keys before a chunk, and the chunk (its first block may be partly before)."""
    return -(-(sliding_window - 1 + max_chunk_tokens) // block_size) + 1


def validate_request(request: Request, vocab_size: int, max_model_len: int, block_size: int,
                     num_gpu_blocks: int, sliding_window: int | None = None,
                     max_chunk_tokens: int = 0) -> None:
    """Raise ValueError, naming the field, when the engine cannot serve `request` (the one
    request validator: `EngineCore.add_request` runs it).

    Causes: an empty prompt; a token id (prompt, output, allowed_token_ids or
    bad_words_token_ids) outside [0, vocab_size); a
    prompt or sequence that leaves no room for a generated token under max_model_len;
    output tokens that already reach max_tokens; no token left to compute; a request whose
    longest possible sequence cannot fit in the whole KV pool of `num_gpu_blocks` blocks
    (block 0 is the null block) - it could never finish. With `sliding_window` (the KV
    cache manager frees out-of-window blocks) a request needs at most the window plus one
    chunk of `max_chunk_tokens`.
    """
    rid, num_prompt = request.request_id, request.num_prompt_tokens
    if num_prompt == 0:
        raise ValueError(f"prompt_token_ids must not be empty (request {rid!r} has an empty "
                         "prompt)")
    sp = request.sampling_params
    for field, ids in (("prompt_token_ids", request.prompt_token_ids),
                       ("output_token_ids", request.output_token_ids),
                       ("allowed_token_ids", sp.allowed_token_ids or ()),
                       ("bad_words_token_ids",
                        [t for word in sp.bad_words_token_ids or () for t in word])):
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{field}: token id {bad!r} is outside the vocabulary "
                             f"[0, {vocab_size})")
    if request.pooling_params is not None:  # prefill only: the prompt may fill the context
        max_model_len += 1
    if num_prompt >= max_model_len:
        raise ValueError(f"prompt_token_ids: prompt length {num_prompt} of request {rid!r} "
                         f"reaches max_model_len {max_model_len} (prompt plus at least one "
                         "generated token must fit)")
    if request.num_tokens >= max_model_len:
        raise ValueError(f"prompt plus output_token_ids ({request.num_tokens} tokens) "
                         f"reach max_model_len {max_model_len}")
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None and request.num_output_tokens >= max_tokens:
        raise ValueError(f"output_token_ids: {request.num_output_tokens} tokens already reach "
                         f"max_tokens={max_tokens}")
    if request.num_computed_tokens >= request.num_tokens:
        raise ValueError(f"request {rid!r} has nothing left to compute "
                         f"({request.num_computed_tokens} of {request.num_tokens} tokens)")
    # Generation stops once num_tokens >= max_model_len; the last token needs no KV.
    max_num_tokens = max_model_len
    if max_tokens is not None:
        max_num_tokens = min(max_num_tokens, num_prompt + max_tokens)
    num_blocks_needed = -(-(max_num_tokens - 1) // block_size)
    if sliding_window is not None:
        num_blocks_needed = min(num_blocks_needed, window_blocks_held(
            sliding_window, block_size, max_chunk_tokens))
    num_usable = num_gpu_blocks - 1
    if num_blocks_needed > num_usable:
        what = ("lower max_tokens" if num_prompt - 1 < num_usable * block_size else
                "the prompt alone is longer than the KV cache holds")
        raise ValueError(f"request {rid!r} may need {num_blocks_needed} KV blocks "
                         f"({max_num_tokens - 1} tokens), more than the pool's {num_usable}; "
                         f"{what}")


def priority_key(request: Request) -> tuple[int, float]:
    """"priority" policy order: the request's `priority` (lower first), then arrival (vLLM's
    priority scheduling)."""
    return request.sampling_params.priority, request.arrival_time


def admission_order(waiting: Iterable[Request], config: SchedulerConfig) -> list[Request]:
    """The waiting requests in the order `Scheduler.schedule()` tries to admit them.

    Preempted requests first (they sit at the queue's front), then, under "sjf", those
    waiting longer than `max_wait_s` in arrival order, then the rest by tokens left to
    compute (ties in arrival order). Source: shortest-job-first minimises mean waiting
    time (Smith's rule; Schrage 1968 for its preemptive form, SRPT); LLM servers apply it
    to prompt length (e.g. Fu et al. 2024, "Efficient LLM Scheduling by Learning to
    Rank"); the wait bound is plain aging.
    """
    waiting = list(waiting)
    if config.scheduling_policy == "priority":
        return sorted(waiting, key=priority_key)
    if config.scheduling_policy == "fcfs" or len(waiting) < 2:
        return waiting
    resumed = [r for r in waiting if r.status == RequestStatus.PREEMPTED]
    fresh = [r for r in waiting if r.status != RequestStatus.PREEMPTED]
    deadline = time.monotonic() - config.max_wait_s
    overdue = sorted((r for r in fresh if r.arrival_time <= deadline),
                     key=lambda r: r.arrival_time)
    rest = [r for r in fresh if r.arrival_time > deadline]
    rest.sort(key=lambda r: r.num_tokens - r.num_computed_tokens)  # stable: ties FCFS
    return resumed + overdue + rest


def prefill_urgency(waiting: Iterable[Request], running: Iterable[Request],
                    config: SchedulerConfig) -> tuple[int, bool]:
    """(prompt tokens left of this engine's next prefill, whether decodes are running),
    for the host's core share (`shared/engine/core_share.py`).

    The next prefill is the shortest one left among waiting requests and running ones
    still in their prompt; a preempted request, or one waiting past `max_wait_s`,
    counts 0 (most urgent). NO_PREFILL when no prompt is left to compute. A waiting stream
    with at most DECODE_LIKE_TOKENS left counts as a decode. Paused requests are in neither
    list: they wait for their client, not for the cores.
    """
    deadline = time.monotonic() - config.max_wait_s
    best = NO_PREFILL
    has_decodes = False
    for r in waiting:
        if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            continue  # its prompt's KV comes from another instance
        if r.status == RequestStatus.PREEMPTED or r.arrival_time <= deadline:
            best = 0
            break
        left = r.num_tokens - r.num_computed_tokens
        if left <= DECODE_LIKE_TOKENS and r.num_output_tokens:
            has_decodes = True  # a stream whose KV arrived: its first decode, not a prefill
        else:
            best = min(best, left)
    for r in running:
        if r.num_computed_tokens >= r.num_prompt_tokens:
            has_decodes = True
        else:
            best = min(best, r.num_prompt_tokens - r.num_computed_tokens)
    return best, has_decodes


def min_tpot_slack(running: Iterable[Request], slo_tpot_s: float, now: float) -> float:
    """Seconds the most hurried running stream could still wait and keep its TPOT target.

    A stream that arrived at `arrival_time` with its first token and has n output tokens
    has used `now - arrival_time` of the `slo_tpot_s * (n - 1)` its target allows for the
    tokens after the first (TPOT = (e2e - TTFT) / (tokens - 1), as vLLM's benchmark counts
    it). inf when no stream is decoding. The decode engine yields its turn on the host's
    cores while this exceeds a reserve (DistServe's slack-aware placement, on one host).
    """
    slack = float("inf")
    for r in running:
        if r.num_computed_tokens >= r.num_prompt_tokens:
            budget = slo_tpot_s * (r.num_output_tokens - 1)
            slack = min(slack, budget - (now - r.arrival_time))
    return slack


def freeing_window(model, speculative_config) -> int | None:
    """The window past which the KV cache manager frees a request's blocks: the largest of
    the model's layer windows when every layer has one; None when any layer attends fully,
    or a draft model shares the block tables (it attends fully over them)."""
    windows = tuple(getattr(model, "sliding_windows", ()) or ())
    if not windows or any(w is None for w in windows):
        return None
    if speculative_config is not None and speculative_config.method == "draft_model":
        return None
    return max(windows)
