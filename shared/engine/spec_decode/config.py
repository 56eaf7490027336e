"""SpeculativeConfig: `--speculative-config` as vLLM spells it (JSON), resolved and frozen."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

_DEFAULT_PROMPT_LOOKUP = 5
"""vLLM's default for prompt_lookup_min / _max when neither is given."""
_DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding on the decode role (the prefill role ignores it)."""

    method: Literal["ngram", "draft_model"]
    """"ngram": prompt lookup, drafts copied from the sequence's own earlier tokens;
    "draft_model": a smaller model with the same tokenizer drafts greedily
    (`shared/engine/spec_decode/draft_model.py`)."""
    num_speculative_tokens: int
    """k: drafts proposed per step; a request is scored on up to k + 1 tokens a step."""
    prompt_lookup_max: int = _DEFAULT_PROMPT_LOOKUP
    """Longest suffix n-gram looked up (tried first)."""
    prompt_lookup_min: int = _DEFAULT_PROMPT_LOOKUP
    """Shortest suffix n-gram looked up."""
    disable_by_batch_size: int = _DEFAULT_DISABLE_BY_BATCH_SIZE
    """Back-off under load: no drafts in a step after which more than this many requests
    run (a busy batch is no longer bound by reading the weights, so verifying drafts costs
    real compute). 0: never back off."""
    model: str | None = None
    """"draft_model" only: the draft's `--model` value (an HF directory, a .gguf file or
    the default model's name)."""
    draft_kv_cache_memory: int | None = None
    """"draft_model" only: bytes of the draft's own paged KV pool; None: as many blocks as
    the target's pool (every running request's draft KV fits)."""

    @classmethod
    def from_value(cls, value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """Parse a JSON string or dict (vLLM's keys); None / "" / {} mean off.

        Raises:
            ValueError: naming the key that is wrong.
        """
        if value is None or value == "" or value == {}:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config: expected a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}  # vLLM's keys
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unsupported key(s) {unknown}; "
                             f"supported: {sorted(known)}")
        model = value.get("model")
        # vLLM: a config naming a draft model needs no method.
        method = value.get("method") or ("draft_model" if model is not None else "ngram")
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config.method: 'ngram' or 'draft_model', "
                             f"got {method!r}")
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise ValueError("speculative_config.model: the draft model's path is required "
                             "with method 'draft_model'")
        if method == "ngram" and model is not None:
            raise ValueError("speculative_config.model: only with method 'draft_model'")
        draft_memory = value.get("draft_kv_cache_memory")
        if draft_memory is not None:
            draft_memory = _parse_size(draft_memory)
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError("speculative_config.num_speculative_tokens: an integer in "
                             f"[1, 16] is required, got {k!r}")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = _DEFAULT_PROMPT_LOOKUP
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"speculative_config.{name}: an integer >= 1, got {n!r}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) exceeds "
                             f"prompt_lookup_max ({hi})")
        backoff = value.get("disable_by_batch_size", _DEFAULT_DISABLE_BY_BATCH_SIZE)
        if not isinstance(backoff, int) or isinstance(backoff, bool) or backoff < 0:
            raise ValueError("speculative_config.disable_by_batch_size: an integer >= 0, "
                             f"got {backoff!r}")
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_max=hi,
                   prompt_lookup_min=lo, disable_by_batch_size=backoff, model=model,
                   draft_kv_cache_memory=draft_memory)


def _parse_size(value: Any) -> int:
    """draft_kv_cache_memory: bytes as an int, or a size such as "256MiB"."""
    from pdserve.shared.engine_args import parse_size

    try:
        size = parse_size(value) if isinstance(value, (int, str)) and \
            not isinstance(value, bool) else -1
    except ValueError:
        size = -1
    if size <= 0:
        raise ValueError("speculative_config.draft_kv_cache_memory: a size such as "
                         f"'256MiB' or a byte count > 0, got {value!r}")
    return size


def check_draft_model(config: SpeculativeConfig, target_vocab_size: int,
                      max_model_len: int) -> None:
    """Before anything loads: the draft of a "draft_model" config exists, shares the
    target's vocabulary and covers max_model_len (reads its config.json only). No-op for
    other methods.

    Raises:
        ValueError / FileNotFoundError: naming speculative_config.model.
    """
    if config.model is None:
        return
    from pdserve.shared.models.convert import resolve_model_path
    from pdserve.shared.models.loader import read_hf_config

    try:
        hf = read_hf_config(resolve_model_path(config.model))
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"speculative_config.model: cannot read the draft "
                                f"{config.model!r}: {e}") from None
    vocab = int(hf.get("vocab_size", -1))
    if vocab != target_vocab_size:
        raise ValueError(f"speculative_config.model: the draft {config.model!r} has a "
                         f"vocabulary of {vocab} tokens, the target {target_vocab_size}; "
                         "the draft must share the target's tokenizer")
    max_pos = int(hf.get("max_position_embeddings", 2048))
    if max_pos < max_model_len:
        raise ValueError(f"speculative_config.model: the draft's max_position_embeddings "
                         f"({max_pos}) is below max_model_len ({max_model_len})")
