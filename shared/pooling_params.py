"""Pooling (embedding) models, vLLM's way: `--runner pooling` / `--convert embed` turn a
decoder checkpoint into an embedding model whose requests are prefill only (torch-free).

    PoolerConfig   the model's pooler (`--pooler-config` / `--override-pooler-config`):
                   pooling_type LAST (default), MEAN or CLS; normalize (L2, default on)
    PoolingParams  one request's: the same two fields, resolved against the config

A pooling request is scheduled like any prompt and finishes when its last prompt chunk is
computed: the model runner pools the final-norm hidden states of its prompt
(shared/engine/pooler.py) instead of sampling, and no token is generated.

NOTE: a prefix-cache hit skips the hit tokens' forward, so their hidden states are never
computed. LAST pooling reads only the last prompt token (always computed: at least one
token of a prompt is), so it uses hits like any prompt; MEAN and CLS read the first or every
token, so their requests skip the prefix-cache lookup (they still fill the cache).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

PoolingType = Literal["LAST", "MEAN", "CLS"]
POOLING_TYPES: tuple[str, ...] = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """vLLM's PoolerConfig, the fields pdserve implements (the defaults of `--convert embed`
    on a decoder: last-token pooling, L2-normalised)."""

    pooling_type: PoolingType = "LAST"
    normalize: bool = True

    @classmethod
    def from_flags(cls, pooler_config: str | dict | None,
                   override_pooler_config: str | dict | None) -> PoolerConfig:
        """--pooler-config JSON (or a dict), with --override-pooler-config's keys over it
        (vLLM's older spelling). Raises ValueError naming the key."""
        merged: dict = {}
        for value in (pooler_config, override_pooler_config):
            if value:
                try:
                    parsed = json.loads(value) if isinstance(value, str) else value
                except json.JSONDecodeError as e:
                    raise ValueError(f"pooler_config: not JSON ({e})") from None
                if not isinstance(parsed, dict):
                    raise ValueError("pooler_config must be a JSON object")
                merged.update(parsed)
        return cls.from_value(merged)

    @classmethod
    def from_value(cls, value: dict) -> PoolerConfig:
        """A --pooler-config object (vLLM's keys). Raises ValueError naming the key."""
        unknown = sorted(set(value) - {"pooling_type", "normalize", "use_activation"})
        if unknown:
            raise ValueError(f"pooler_config: {', '.join(unknown)} not supported (pdserve "
                             "implements pooling_type and normalize)")
        pooling_type = str(value.get("pooling_type") or "LAST").upper()
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config: pooling_type must be one of "
                             f"{', '.join(POOLING_TYPES)}, got {value.get('pooling_type')!r}")
        normalize = value.get("normalize", value.get("use_activation", True))
        if not isinstance(normalize, bool):
            raise ValueError(f"pooler_config: normalize must be true or false, got "
                             f"{normalize!r}")
        return cls(pooling_type, normalize)  # type: ignore[arg-type]


def resolve_runner(runner: str, convert: str) -> str:
    """--runner / --convert -> "generate" or "pooling" (vLLM's: --convert embed implies
    pooling). Raises ValueError for --runner generate with --convert embed."""
    if runner not in ("auto", "generate", "pooling"):
        raise ValueError(f"runner must be auto, generate or pooling, got {runner!r}")
    if convert not in ("auto", "none", "embed"):
        raise ValueError(f"convert must be auto, none or embed, got {convert!r}")
    if convert == "embed" and runner == "generate":
        raise ValueError("--convert embed needs --runner pooling (or auto)")
    return "pooling" if runner == "pooling" or convert == "embed" else "generate"


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """One pooling request's pooler: the model's, with `normalize` overridable per request
    (vLLM's `use_activation`)."""

    pooling_type: PoolingType = "LAST"
    normalize: bool = True

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether the request may skip its prefix-cache hits' forward (see module doc)."""
        return self.pooling_type == "LAST"

    @classmethod
    def resolve(cls, config: PoolerConfig, normalize: bool | None = None) -> PoolingParams:
        return cls(config.pooling_type, config.normalize if normalize is None else normalize)


def uses_prefix_hits(request: Any) -> bool:
    """Whether `request` (a generate or pooling one) may take prefix-cache hits."""
    params = request.pooling_params
    return params is None or params.uses_prefix_cache


def finish_pooling(request: Any, pooled: Any):
    """Mark a pooling request whose prompt is computed FINISHED_STOPPED; returns its
    EngineCoreOutput (its `pooled` vector, no token). The scheduler frees it after."""
    from pdserve.shared.engine.scheduler_output import EngineCoreOutput
    from pdserve.shared.request import RequestStatus

    request.status = RequestStatus.FINISHED_STOPPED
    return EngineCoreOutput(
        request_id=request.request_id, new_token_ids=[], new_logprobs=[],
        finish_reason=request.finish_reason, stop_reason=None,
        num_cached_tokens=max(request.num_cached_tokens, 0), pooled=pooled)
