"""The benchmark workloads of ../shared/bench/workloads.md, deterministic for a seed.

`single`: 5 sequential requests, ~30 prompt tokens, 128 output tokens.
`mixed64`: 64 requests at once, prompts of 20-400 tokens, 32-256 output tokens.
`prefix32`: 32 requests at once sharing a ~1000-token prefix + a ~20-token suffix, 16 out.
Prompts are English-like word salad (~1.1 SmolLM2 tokens per word).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORDS = (
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money "
    "story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city name "
    "good new first last long great little own other old right big high different small "
    "large next early young important few public bad same able make take see come know "
    "think look want give use find tell ask seem feel try leave call keep let begin help "
    "show hear play run move live believe bring happen write sit stand lose pay meet "
    "include continue set learn change lead understand watch follow stop create speak "
    "read spend grow open walk win teach offer remember consider appear buy serve die "
    "send build stay fall cut reach kill raise pass sell decide return explain hope "
    "and the of to in for on with at by from about as into like through after over"
).split()
_TOKENS_PER_WORD = 1.1


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str
    max_tokens: int


def word_salad(rng: random.Random, n_tokens: int) -> str:
    """About `n_tokens` tokens of capitalised, full-stopped word salad."""
    words, since = [], 0
    for _ in range(max(1, round(n_tokens / _TOKENS_PER_WORD))):
        w = rng.choice(_WORDS)
        if since == 0:
            w = w.capitalize()
        since += 1
        if since >= rng.randint(8, 16):
            w, since = w + ".", 0
        words.append(w)
    return " ".join(words)


def build_workload(name: str, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    if name == "single":
        return [BenchRequest(word_salad(rng, 30), 128) for _ in range(5)]
    if name == "mixed64":
        return [BenchRequest(word_salad(rng, rng.randint(20, 400)), rng.randint(32, 256))
                for _ in range(64)]
    if name == "prefix32":
        prefix = word_salad(rng, 1000)
        return [BenchRequest(f"{prefix} Question {i}: {word_salad(rng, 16)}", 16)
                for i in range(32)]
    raise ValueError(f"unknown workload {name!r} (single, mixed64, prefix32)")
