"""The model's `generation_config.json` as default sampling parameters (vLLM's
`--generation-config auto`, its default).

A checkpoint's generation config names the sampling its authors recommend (Qwen2.5-Instruct:
temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05) and the token ids that end a
turn (Llama 3.x: `<|end_of_text|>`, `<|eom_id|>`, `<|eot_id|>`), where the tokenizer names
only one EOS. As vLLM does (`ModelConfig.get_diff_sampling_param`,
`SamplingParams.update_from_generation_config`): a request field left unset takes the
config's value, `max_new_tokens` caps every request's max_tokens, and the config's EOS ids
other than the tokenizer's are added to the request's `stop_token_ids` unless `ignore_eos`
(so they also wait for `min_tokens`, and a turn ended by one reports it as `stop_reason`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The generation-config keys vLLM takes as request defaults (and pdserve does)."""


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Defaults from a generation config; None: the config does not set it."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    """At most this many tokens per completion (vLLM maps it to a `max_tokens` cap)."""
    extra_eos_token_ids: tuple[int, ...] = ()
    """The config's EOS ids other than the tokenizer's (added to stop_token_ids)."""

    def pick(self, name: str, requested, fallback):
        """`requested` if the request set it, else this config's value, else `fallback`."""
        if requested is not None:
            return requested
        value = getattr(self, name)
        return fallback if value is None else value


def load_generation_defaults(source: str, model_path: str,
                             tokenizer_eos_token_id: int | None) -> GenerationDefaults:
    """The defaults for `--generation-config SOURCE`.

    Args:
        source: "auto" (the model directory's generation_config.json), "vllm" (none:
            vLLM's own defaults), or a directory holding a generation_config.json.
        model_path: the model directory.
        tokenizer_eos_token_id: the tokenizer's EOS (the engines stop on it already).

    Raises:
        FileNotFoundError: `source` is a directory without a generation_config.json.
        ValueError: the file is not a JSON object, or a value has the wrong type.
    """
    if source == "vllm":
        return GenerationDefaults()
    directory = Path(model_path if source == "auto" else source)
    path = directory / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise FileNotFoundError(f"--generation-config: no generation_config.json in "
                                    f"{directory}")
        return GenerationDefaults()
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    values: dict = {}
    for name in SAMPLING_FIELDS:
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: {name} must be a number, got {value!r}")
        values[name] = int(value) if name == "top_k" else float(value)
    max_new = config.get("max_new_tokens")
    if max_new is not None:
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"{path}: max_new_tokens must be a positive integer, got "
                             f"{max_new!r}")
        values["max_new_tokens"] = max_new
    eos = config.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in eos_ids):
        raise ValueError(f"{path}: eos_token_id must be an id or a list of ids, got {eos!r}")
    extra = tuple(dict.fromkeys(i for i in eos_ids if i != tokenizer_eos_token_id))
    defaults = GenerationDefaults(**values, extra_eos_token_ids=extra)
    if values or extra:
        logger.info("default sampling parameters from %s (a request's own values win): %s",
                    path, defaults)
    return defaults
