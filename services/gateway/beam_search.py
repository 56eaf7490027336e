"""Beam search (vLLM's `use_beam_search`, `n` beams, `length_penalty`) on both endpoints.

As vLLM's OpenAI server does it (`EngineClient.beam_search`), on top of ordinary requests:
each step sends every live beam as a prompt with max_tokens 1 and logprobs 2 * n; each beam's
candidates are its sampled token and those alternatives. A candidate EOS ends its beam
(unless ignore_eos); the other candidates, ranked by cumulative logprob, keep the n best
beams. After max_tokens steps the finished and live beams are ranked by vLLM's
`get_beam_search_score` (cumulative logprob / sequence length ** length_penalty, the length
counting the prompt and not a final EOS) and the n best are the choices, best first.

    step k:   beams (n)  ──▶ n requests, prompt = prompt + beam tokens, max_tokens 1
                         ◀── per beam: up to 2n + 1 (token, logprob) candidates
              new beams = top n of all (beam + token) by cumulative logprob
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse

from pdserve.services.gateway.errors import bad_request
from pdserve.services.gateway.protocol import ChatCompletionRequest, SamplingRequest
from pdserve.services.gateway.serving import OpenAIServing, PromptInput
from pdserve.services.gateway.streams import run_until_disconnect
from pdserve.services.gateway.tenancy import request_cache_salt
from pdserve.shared.sampling_params import SamplingParams

_WITH_BEAM_SEARCH = frozenset({
    "model", "prompt", "use_beam_search", "n", "best_of", "max_tokens", "temperature",
    "length_penalty", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
    "add_special_tokens", "truncate_prompt_tokens", "truncation_side", "request_id",
    "cache_salt", "user", "stream", "messages", "max_completion_tokens",
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs"})
"""The request fields beam search honours (vLLM's BeamSearchParams, plus the prompt's)."""


@dataclass(slots=True)
class Beam:
    token_ids: list[int]
    """The prompt's and the generated tokens."""
    cum_logprob: float = 0.0
    finish_reason: str | None = None
    """"stop" (EOS), "length" (max_tokens), None while live."""
    stop_reason: int | None = None
    """The EOS id that ended it ("stop")."""
    generated: list[int] = field(default_factory=list)
    """The tokens the answer shows (a final EOS only with include_stop_str_in_output)."""


def check_beam_search(req: SamplingRequest, max_logprobs: int) -> None:
    """Refuse what beam search does not honour, naming the field.

    Raises:
        GatewayError: 400: stream, a field outside `_WITH_BEAM_SEARCH` set to a non-default
            value, or n so large that 2 * n alternatives exceed max_logprobs.
    """
    if req.stream:
        raise bad_request("use_beam_search does not stream; set stream to false", "stream")
    # NOTE: fields the model does not name are check_unsupported's (vLLM's) or ignored.
    for name in sorted(req.model_fields_set - _WITH_BEAM_SEARCH):
        info = type(req).model_fields.get(name)
        if info is not None and getattr(req, name) != info.get_default(
                call_default_factory=True):
            raise bad_request(f"{name} is not supported with use_beam_search", name)
    if 2 * req.n > max_logprobs:
        raise bad_request(f"use_beam_search: n must be at most {max_logprobs // 2}", "n")


def beam_score(beam: Beam, eos_token_id: int | None, length_penalty: float) -> float:
    """vLLM's `get_beam_search_score`."""
    seq_len = len(beam.token_ids)
    if beam.token_ids[-1] == eos_token_id:
        seq_len -= 1
    return beam.cum_logprob / (seq_len ** length_penalty)


async def run_beam_search(serving: OpenAIServing, req: SamplingRequest, prompt: list[int],
                          max_tokens: int, *, cache_salt: str | None, engine_prefix: str,
                          request_id: str) -> list[Beam]:
    """The n best beams of `prompt`, best first (module docstring)."""
    width, eos = req.n, serving.tokenizer.eos_token_id
    step_params = SamplingParams(temperature=1.0 if req.temperature is None else
                                 req.temperature, max_tokens=1, logprobs=2 * width,
                                 ignore_eos=True)
    beams, finished = [Beam(list(prompt))], []
    for step in range(max_tokens):
        candidates = []
        for beam, logprobs in zip(beams, await _step(serving, beams, step_params, cache_salt,
                                                     f"{engine_prefix}-b{step}", request_id),
                                  strict=True):
            for token_id, logprob in logprobs.items():
                cum = beam.cum_logprob + logprob
                if token_id == eos and not req.ignore_eos:
                    kept = [token_id] if req.include_stop_str_in_output else []
                    finished.append(Beam(beam.token_ids + [token_id], cum, "stop", token_id,
                                         beam.generated + kept))
                else:
                    candidates.append(Beam(beam.token_ids + [token_id], cum, None, None,
                                           beam.generated + [token_id]))
        beams = sorted(candidates, key=lambda b: b.cum_logprob, reverse=True)[:width]
        if not beams:
            break
    for beam in beams:
        beam.finish_reason = "length"
    return sorted(finished + beams, key=lambda b: beam_score(b, eos, req.length_penalty),
                  reverse=True)[:width]


async def _step(serving: OpenAIServing, beams: list[Beam], params: SamplingParams,
                cache_salt: str | None, engine_prefix: str, request_id: str
                ) -> list[dict[int, float]]:
    """One step: per beam, {candidate token: logprob} (the sampled token and the top 2n)."""
    run = serving.start([PromptInput(b.token_ids) for b in beams], [params] * len(beams),
                        stop=[], include_stop_str_in_output=False, logprobs=True,
                        cache_salt=cache_salt, engine_prefix=engine_prefix,
                        request_id=request_id)
    out: list[dict[int, float]] = [{} for _ in beams]
    try:
        async for delta in run.deltas:
            for lp in delta.logprobs or ():
                out[delta.index].update(lp.top)
                out[delta.index][lp.token_id] = lp.logprob
    finally:
        await run.close()
    return out


async def respond_beam_search(serving: OpenAIServing, req: SamplingRequest, request: Request,
                              prompts: list[PromptInput], max_tokens: list[int],
                              response_id: str) -> JSONResponse:
    """Run the search of every prompt (cancelled if the client leaves) and answer in vLLM's
    shape: one choice per beam (index = prompt index * n + rank), best first; a completion's
    `text` or a chat `message`."""
    check_beam_search(req, serving.config.max_logprobs)
    state = request.state
    salt = request_cache_salt(state.tenant_cache_salt, req.cache_salt)

    async def search() -> list[list[Beam]]:
        return [await run_beam_search(
            serving, req, p.token_ids, m, cache_salt=salt, request_id=state.request_id,
            engine_prefix=f"{state.engine_request_prefix}-p{i}")
            for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]

    results = await serving._until_cut(request, run_until_disconnect(request.receive,
                                                                     search()))
    chat = isinstance(req, ChatCompletionRequest)
    choices, completion_tokens = [], 0
    for p, beams in enumerate(results):
        for i, beam in enumerate(beams):
            completion_tokens += len(beam.generated)
            text = serving.tokenizer.decode(beam.generated,
                                            skip_special_tokens=req.skip_special_tokens)
            output = {"message": {"role": "assistant", "content": text}} if chat else \
                {"text": text}
            choices.append({"index": p * req.n + i, **output, "logprobs": None,
                            "finish_reason": beam.finish_reason,
                            "stop_reason": beam.stop_reason})
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    return JSONResponse({
        "id": response_id, "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": serving.config.served_model_name,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens}})
