"""The multi-turn chat workload of benchmarks/kv_tiers.py: conversations, the client, stats.

N conversations share one system prompt; every conversation has T turns (a seeded user
message each, the first with a document of the conversation's own: multi-round QA over a
document, as LMCache benchmarks KV offloading; the assistant's answer, generated greedily,
goes back into the history as it came). Turns go round-robin in rounds: round t sends
turn t of conversation 0, 1, ..., N-1 (at most `concurrency` in flight), and round t + 1
starts when round t is done. So between two turns of one conversation the other N - 1
conversations' turns pass through the engine: with a pool far smaller than all the
histories, a returning turn finds its blocks evicted.

    round 0 (first turns)     c0.t0  c1.t0  ...  cN-1.t0
    round 1 (returning)       c0.t1  c1.t1  ...  cN-1.t1      <- c0's history was pushed out
    ...                                                          by N - 1 other turns

Engine metrics are read between rounds (the `snapshot` callback), so the first-turn round
and the returning rounds have their own counter deltas.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx

from benchmarks.goodput import percentile
from benchmarks.workloads import word_salad


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    num_conversations: int
    num_turns: int
    system_tokens: int
    """About this many tokens of system prompt, shared by every conversation."""
    user_tokens: tuple[int, int]
    """(min, max) tokens of one user message, uniform."""
    max_tokens: int
    concurrency: int
    seed: int
    doc_tokens: int = 0
    """About this many tokens of a document of the conversation's own in its first user
    message (multi-round QA over a document, LMCache's workload): 0, none."""


@dataclass(frozen=True, slots=True)
class Workload:
    system_prompt: str
    user_messages: tuple[tuple[str, ...], ...]
    """[num_conversations][num_turns] user messages."""
    probe_message: str
    """The extra user turn of the restart scenario."""
    warmup_messages: tuple[list[dict], ...]
    """Chats sent after a server starts, before measuring; their own system prompt, so they
    cache nothing the workload uses."""


def build_workload(cfg: WorkloadConfig) -> Workload:
    rng = random.Random(cfg.seed)
    system = "You are a helpful assistant. Background notes: " + word_salad(
        rng, cfg.system_tokens)
    def document(c: int) -> str:
        return f"Document {c}: {word_salad(rng, cfg.doc_tokens)}\n\n" if cfg.doc_tokens else ""

    users = tuple(tuple((document(c) if t == 0 else "") + f"Question {c}.{t}: "
                        + word_salad(rng, rng.randint(*cfg.user_tokens))
                        for t in range(cfg.num_turns))
                  for c in range(cfg.num_conversations))
    probe = "One more question: " + word_salad(rng, cfg.user_tokens[0])
    warm_rng = random.Random(cfg.seed - 1)
    warm_system = "You are a terse assistant. " + word_salad(warm_rng, 40)
    # NOTE: the second warm-up prompt is as long as a first turn, so the first measured
    # prefill of that size pays no one-off cost.
    warmup = tuple([{"role": "system", "content": warm_system},
                    {"role": "user", "content": word_salad(warm_rng, n)}]
                   for n in (30, cfg.system_tokens + cfg.user_tokens[1]))
    return Workload(system, users, probe, warmup)


@dataclass(slots=True)
class TurnRecord:
    """One chat request; times in seconds from its send."""

    conversation: int
    turn: int
    ok: bool = False
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    """usage.prompt_tokens_details.cached_tokens (None: the server did not say)."""
    completion_tokens: int = 0
    answer: str = ""
    error: str | None = None


async def stream_chat(client: httpx.AsyncClient, model: str, messages: list[dict],
                      max_tokens: int, record: TurnRecord) -> TurnRecord:
    """Stream one greedy chat completion into `record`: TTFT at the first content delta."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    parts: list[str] = []
    usage: dict | None = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return record
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = str(chunk["error"])[:200]
                    return record
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    if text := (choice.get("delta") or {}).get("content"):
                        if record.ttft is None:
                            record.ttft = time.perf_counter() - t0
                        parts.append(text)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"[:200]
        return record
    record.e2e = time.perf_counter() - t0
    record.answer = "".join(parts)
    usage = usage or {}
    record.prompt_tokens = usage.get("prompt_tokens", 0)
    record.completion_tokens = usage.get("completion_tokens", 0)
    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    record.ok = record.ttft is not None
    if not record.ok:
        record.error = "no content streamed"
    return record


def history(workload: Workload, conversation: int, answers: list[str]) -> list[dict]:
    """The messages of `conversation` up to and including its turn len(answers)."""
    msgs = [{"role": "system", "content": workload.system_prompt}]
    for t, answer in enumerate(answers):
        msgs += [{"role": "user", "content": workload.user_messages[conversation][t]},
                 {"role": "assistant", "content": answer}]
    msgs.append({"role": "user", "content": workload.user_messages[conversation][len(answers)]})
    return msgs


@dataclass(slots=True)
class RunResult:
    records: list[TurnRecord]
    answers: list[list[str]]
    """[conversation] the assistant answers, in turn order."""
    wall_s: float
    snapshots: list[dict] = field(default_factory=list)
    """The `snapshot` callback's value before round 0 and after every round."""


def make_client(base_url: str, timeout: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=base_url, limits=limits,
                             timeout=httpx.Timeout(timeout, connect=30.0))


async def warm_up(base_url: str, model: str, workload: Workload) -> None:
    async with make_client(base_url, 600) as client:
        for i, messages in enumerate(workload.warmup_messages):
            rec = await stream_chat(client, model, messages, 8, TurnRecord(-1, i))
            if not rec.ok:
                print(f"  warm-up failed: {rec.error}", flush=True)


async def run_workload(base_url: str, model: str, workload: Workload, cfg: WorkloadConfig,
                       snapshot: Callable[[], dict], timeout: float = 900.0) -> RunResult:
    """Every turn of every conversation, round by round (see the module docstring)."""
    n = cfg.num_conversations
    answers: list[list[str]] = [[] for _ in range(n)]
    records: list[TurnRecord] = []
    snapshots = [await asyncio.to_thread(snapshot)]
    sem = asyncio.Semaphore(cfg.concurrency)

    async def one(client: httpx.AsyncClient, c: int, t: int) -> TurnRecord:
        async with sem:
            return await stream_chat(client, model, history(workload, c, answers[c]),
                                     cfg.max_tokens, TurnRecord(c, t))

    start = time.perf_counter()
    async with make_client(base_url, timeout) as client:
        for t in range(cfg.num_turns):
            t_round = time.perf_counter()
            done = await asyncio.gather(*(one(client, c, t) for c in range(n)))
            for rec in done:
                # NOTE: a failed turn leaves an empty answer, so the conversation goes on
                # with the same number of turns on every system.
                answers[rec.conversation].append(rec.answer)
            records += done
            snapshots.append(await asyncio.to_thread(snapshot))
            ok = [r for r in done if r.ok]
            ttft = percentile([r.ttft for r in ok if r.ttft is not None], 50)
            print(f"  round {t}: {len(ok)}/{n} ok in {time.perf_counter() - t_round:.1f} s, "
                  f"TTFT p50 {_ms(ttft)} ms, cached {_cached_frac(ok)}", flush=True)
    return RunResult(records, answers, time.perf_counter() - start, snapshots)


async def send_probe(base_url: str, model: str, workload: Workload, conversation: int,
                     answers: list[str], max_tokens: int) -> TurnRecord:
    """The restart scenario's request: `conversation`'s whole history, then the probe turn."""
    msgs = history(workload, conversation, answers[:-1])
    msgs += [{"role": "assistant", "content": answers[-1]},
             {"role": "user", "content": workload.probe_message}]
    async with make_client(base_url, 600) as client:
        return await stream_chat(client, model, msgs, max_tokens,
                                 TurnRecord(conversation, len(answers)))


# ---- statistics ----------------------------------------------------------------------------

def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _cached_frac(records: list[TurnRecord]) -> str:
    known = [r for r in records if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in known)
    return f"{sum(r.cached_tokens or 0 for r in known) / prompt:.2f}" if prompt else "-"


def latency_ms(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": None if (p := percentile(values, q)) is None else p * 1000
            for q in (50, 90)}


def summarize_records(result: RunResult, system_prompt_tokens: int) -> dict:
    """Per-run figures from the client's side: TTFT of first and returning turns, tok/s, and
    the cached fraction of the prompts (usage), of all of it and of the part after the shared
    system prompt (the conversation's own history, which a returning turn hopes to find)."""
    ok = [r for r in result.records if r.ok]
    first = [r for r in ok if r.turn == 0]
    returning = [r for r in ok if r.turn > 0]
    out_tokens = sum(r.completion_tokens for r in ok)

    def cached(rs: list[TurnRecord]) -> float | None:
        known = [r for r in rs if r.cached_tokens is not None]
        prompt = sum(r.prompt_tokens for r in known)
        return sum(r.cached_tokens or 0 for r in known) / prompt if prompt else None

    def history_cached(rs: list[TurnRecord]) -> float | None:
        known = [r for r in rs if r.cached_tokens is not None]
        own = sum(r.prompt_tokens - system_prompt_tokens for r in known)
        return (sum(max((r.cached_tokens or 0) - system_prompt_tokens, 0) for r in known) / own
                if own > 0 else None)

    return {
        "requests": len(result.records), "failed": len(result.records) - len(ok),
        "errors": sorted({r.error for r in result.records if r.error})[:3],
        "wall_s": result.wall_s,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / result.wall_s if result.wall_s > 0 else None,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "first_ttft_ms": latency_ms([r.ttft for r in first if r.ttft is not None]),
        "returning_ttft_ms": latency_ms([r.ttft for r in returning if r.ttft is not None]),
        "first_cached_frac": cached(first),
        "returning_cached_frac": cached(returning),
        "returning_history_cached_frac": history_cached(returning),
        "final_context_tokens": [max((r.prompt_tokens + r.completion_tokens
                                      for r in ok if r.conversation == c), default=0)
                                 for c in range(len(result.answers))],
    }


def records_json(result: RunResult) -> list[dict]:
    return [{k: v for k, v in asdict(r).items() if k != "answer"} for r in result.records]
