"""SamplingParams: per-request decoding knobs, validated at construction (torch-free).

Names and meanings follow vLLM's `SamplingParams` and the OpenAI API. Every invalid
value raises `ValueError` whose message starts with the offending field's name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.shared.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request.

    Raises:
        ValueError: naming the field, for any out-of-range value.
    """

    n: int = 1
    """Number of independent completions (the gateway fans these out as requests)."""
    temperature: float = 1.0
    """0 means greedy (argmax). Must be >= 0."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p * p(most likely); in [0, 1]."""
    seed: int | None = None
    """Per-request RNG seed; a seeded result does not depend on the rest of the batch."""
    presence_penalty: float = 0.0
    """OpenAI presence penalty in [-2, 2], over generated tokens."""
    frequency_penalty: float = 0.0
    """OpenAI frequency penalty in [-2, 2], over generated tokens."""
    repetition_penalty: float = 1.0
    """CTRL-style penalty (> 0) over prompt and generated tokens; 1 disables."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the context length."""
    min_tokens: int = 0
    """EOS and stop tokens are suppressed until this many tokens were generated."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end generation (finish_reason "stop")."""
    ignore_eos: bool = False
    """Keep generating past the EOS token."""
    logprobs: int | None = None
    """Number of top alternatives to return per generated token (0 = chosen only)."""
    prompt_logprobs: int | None = None
    """Number of top alternatives per prompt token (used for echo); set, the request skips
    the prefix cache (every prompt position needs its logits)."""
    skip_special_tokens: bool = True
    """Detokenization: drop special tokens from the returned text."""
    logit_bias: dict[int, float] | None = None
    """OpenAI logit_bias: token id -> value added to its logit before sampling (greedy
    too; logprobs stay those of the raw logits, as vLLM's)."""
    allowed_token_ids: list[int] | None = None
    """vLLM's: only these token ids may be sampled (every other logit is -inf before
    sampling, greedy too; logprobs stay those of the raw logits). Non-empty when set."""
    bad_words_token_ids: list[list[int]] | None = None
    """vLLM's `bad_words` tokenized (`_bad_words_token_ids`, by the gateway: each word with
    and without a leading space): a one-token word is never sampled; a longer one's last
    token is banned while the output so far ends with the word's other tokens."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (vLLM's name); the
    request ends when the grammar does (EOS allowed only where it accepts)."""
    priority: int = 0
    """Scheduling, not sampling: vLLM's request `priority` (lower is admitted first, and
    preempted last); an engine refuses a non-zero one unless its --scheduling-policy is
    "priority". Carried with the params since every engine request holds them."""

    def __post_init__(self) -> None:
        self._verify()

    def _verify(self) -> None:
        _check_int("n", self.n, lo=1)
        _check_int("priority", self.priority)
        _check_float("temperature", self.temperature, lo=0.0)
        _check_float("top_p", self.top_p, lo=0.0, lo_open=True, hi=1.0)
        _check_int("top_k", self.top_k, lo=-1)
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed)
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        _check_token_id_list("stop_token_ids", self.stop_token_ids)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=20)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=20)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict, got {self.logit_bias!r}")
            for token_id, bias in self.logit_bias.items():
                _check_int("logit_bias token id", token_id, lo=0)
                _check_float("logit_bias", bias)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            _check_token_id_list("allowed_token_ids", self.allowed_token_ids)
        if self.bad_words_token_ids is not None:
            if not isinstance(self.bad_words_token_ids, list):
                raise ValueError(f"bad_words_token_ids must be a list, got "
                                 f"{self.bad_words_token_ids!r}")
            for word in self.bad_words_token_ids:
                _check_token_id_list("bad_words_token_ids", word)
                if not word:
                    raise ValueError("bad_words_token_ids must not hold an empty word")
        if self.structured_outputs is not None and \
                not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def _check_token_id_list(name: str, value: object) -> None:
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ValueError(f"{name} must be a list of non-negative ints, got {value!r}")


def _check_float(name: str, value: object, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if math.isnan(v) or math.isinf(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        op = ">" if lo_open else ">="
        raise ValueError(f"{name} must be {op} {lo}, got {value}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
