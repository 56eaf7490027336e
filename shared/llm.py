"""Offline API, as vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))` and
`.chat(messages, ...)`, running the engine core in this process."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.shared.engine.engine_core import EngineCore
from pdserve.shared.engine_args import EngineArgs
from pdserve.shared.lora.request import LoRARequest
from pdserve.shared.request import Request, TokenLogprobs
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.tokenizer import apply_chat_template, get_tokenizer


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    """"stop", "length" or "abort"."""
    stop_reason: int | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = True
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With `SamplingParams.prompt_logprobs`: one per prompt token, the first None (vLLM's
    `RequestOutput.prompt_logprobs`, with TokenLogprobs for its dicts)."""


PromptType = str | list[int] | dict


class LLM:
    """An engine core in this process, driven to completion for a list of prompts.

    Keyword arguments are `EngineArgs` fields (`max_num_seqs`, `block_size`,
    `enable_prefix_caching`, `num_gpu_blocks_override`, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        args = EngineArgs(**({"model": model} if model else {}), **kwargs)
        configs = args.create_engine_configs()
        self.model_config = configs[0]
        self.engine = EngineCore(*configs, speculative_config=args.create_speculative_config(),
                                 lora_config=args.create_lora_config())
        self.tokenizer = get_tokenizer(self.model_config.model_path)
        self.eos_token_id = self.tokenizer.eos_token_id
        self._counter = itertools.count()

    def _to_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, dict):
            return None, list(prompt["prompt_token_ids"])
        return None, list(prompt)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or {"prompt_token_ids": [...]}).

        `lora_request` (vLLM's): one adapter for every prompt, or one per prompt (None: the
        base model); an adapter not loaded yet is loaded first (`EngineCore.add_lora`).

        Raises:
            ValueError: naming the field, for a prompt or parameter the engine rejects;
                nothing stays queued.
        """
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = _one_per_prompt("sampling_params", sampling_params or SamplingParams(),
                                      len(prompts))
        loras = _one_per_prompt("lora_request", lora_request, len(prompts))
        for lora in {lr.lora_int_id: lr for lr in loras if lr is not None}.values():
            if lora.lora_int_id not in self.engine.list_loras():
                self.engine.add_lora(lora)
        outputs: dict[str, RequestOutput] = {}
        requests: dict[str, tuple[RequestOutput, int, Request]] = {}
        added: list[str] = []
        try:
            for prompt, sp, lora in zip(prompts, params_list, loras):
                text, ids = self._to_token_ids(prompt)
                rid = str(next(self._counter))
                out = RequestOutput(rid, text, ids)
                outputs[rid] = out
                hashes: list[bytes] = []  # the n choices share the prompt's, hashed once
                for index in range(sp.n):
                    child = dataclasses.replace(sp, n=1)
                    if sp.seed is not None:
                        child.seed = sp.seed + index
                    req = Request(f"{rid}-{index}", ids, child, eos_token_id=self.eos_token_id,
                                  lora_request=lora, block_hashes=list(hashes),
                                  block_hasher=self.engine.kv_cache_manager.block_hasher)
                    hashes = req.block_hashes
                    self.engine.add_request(req)
                    added.append(req.request_id)
                    requests[req.request_id] = (out, index, req)
        except ValueError:
            self.engine.abort_requests(added)
            raise
        while self.engine.has_unfinished_requests():
            self.engine.step()
            if not self.engine.last_step_scheduled:  # waits on a disk load: let it run
                time.sleep(0.0005)
        for out, index, req in requests.values():
            out.outputs.append(CompletionOutput(
                index=index,
                text=self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True),
                token_ids=list(req.output_token_ids),
                logprobs=list(req.output_logprobs) if req.sampling_params.logprobs is not None
                else None,
                finish_reason=req.finish_reason.value if req.finish_reason else None,
                stop_reason=req.stop_reason))
            out.num_cached_tokens = max(out.num_cached_tokens, req.num_cached_tokens)
            if out.prompt_logprobs is None and req.prompt_logprobs is not None:
                out.prompt_logprobs = list(req.prompt_logprobs)
        return list(outputs.values())  # each one's choices in index order (added so)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the chat template (with the generation prompt) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": apply_chat_template(self.tokenizer, conv,
                                                            add_generation_prompt)}
                   for conv in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params)


def _one_per_prompt(name: str, value: Any, num_prompts: int) -> list:
    """`value` repeated per prompt, or a list or tuple of one per prompt (ValueError else)."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * num_prompts
    if len(values) != num_prompts:
        raise ValueError(f"{name}: need one per prompt")
    return values
