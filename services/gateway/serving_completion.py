"""POST /v1/completions: prompts (text, token ids, or lists of them), echo, integer logprobs."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from starlette.requests import Request
from starlette.responses import Response

from pdserve.services.gateway.beam_search import respond_beam_search
from pdserve.services.gateway.errors import GatewayError, bad_request
from pdserve.services.gateway.output_processor import ChoiceDelta, ChoiceProcessor, TokenLogprob
from pdserve.services.gateway.prompt_logprobs import check_prompt_logprobs, prompt_logprobs_json
from pdserve.services.gateway.protocol import CompletionRequest, check_unsupported
from pdserve.services.gateway.sampling import (
    build_sampling_params,
    check_limits,
    check_logprobs,
    check_token_ids,
    resolve_max_tokens,
    tokenize_bad_words,
    truncate_prompt,
)
from pdserve.services.gateway.serving import (
    ChoiceRun,
    OpenAIServing,
    PromptInput,
    chunk_usage,
    clamp_logprob,
    response_id,
    static_deltas,
    token_label,
)
from pdserve.services.gateway.structured_outputs import resolve_structured_outputs
from pdserve.services.gateway.tenancy import request_cache_salt

_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for this endpoint


class CompletionServing(OpenAIServing):
    route = "/v1/completions"

    async def _prompts(self, req: CompletionRequest) -> list[PromptInput]:
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        # Cheap refusals first: before a single prompt is tokenized.
        self.admission.check_fits(len(prompt) * req.n,
                                  param="n" if req.n > 1 else "prompt")
        await self.check_prompt_chars(sum(len(p) for p in prompt if isinstance(p, str)),
                                      "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append(PromptInput(
                    await self.tokenizer.encode_prompt(p, req.add_special_tokens), p))
            else:
                check_token_ids(p, self.tokenizer.vocab_size, "prompt")
                out.append(PromptInput(list(p)))
            if not out[-1].token_ids:
                raise bad_request("prompt must not be empty", "prompt")
        return out

    def prompt_text(self, prompt: PromptInput) -> str:
        if prompt.text is None:
            prompt.text = self.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
        return prompt.text

    async def create(self, req: CompletionRequest, request: Request) -> Response:
        check_unsupported(req)
        lora = await self.resolve_model(req.model, bool(req.use_beam_search))
        check_limits(req, self.config)
        check_logprobs(req.logprobs, "logprobs", self.config.max_logprobs)
        check_prompt_logprobs(req, self.config.max_logprobs)
        structured_outputs, guided_param = resolve_structured_outputs(req)
        prompts = await self._prompts(req)
        bad_words_token_ids = await tokenize_bad_words(req.bad_words,
                                                       self.tokenizer.encode_prompt)
        max_model_len = (await self.engine.engine_info()).max_model_len
        if req.truncate_prompt_tokens is not None:
            prompts = [PromptInput(truncate_prompt(p.token_ids, req.truncate_prompt_tokens,
                                                   max_model_len, req.truncation_side))
                       for p in prompts]
        if req.use_beam_search:  # not streamed (check_beam_search)
            return await respond_beam_search(
                self, req, request, prompts,
                [resolve_max_tokens(len(p.token_ids), req.max_tokens, max_model_len,
                                    default=_DEFAULT_MAX_TOKENS,
                                    cap=self.generation_defaults.max_new_tokens)
                 for p in prompts],
                f"cmpl-{response_id(req, request)}")
        # NOTE: echo with max_tokens 0 generates nothing, but the prompt must still fit.
        echo_only = req.echo and req.max_tokens == 0
        # echo + logprobs (or prompt_logprobs): the engine returns the prompt's logprobs with
        # the first token; with max_tokens 0 it runs one token only for them, and that token
        # is dropped. The engine computes the larger top-k of the two; each use slices it.
        prompt_logprobs = max((k for k in (req.logprobs if req.echo else None,
                                           req.prompt_logprobs) if k is not None), default=None)
        prompt_only = echo_only and prompt_logprobs is not None
        echo_only = echo_only and not prompt_only
        sampling = [dataclasses.replace(build_sampling_params(
            req, max_tokens=resolve_max_tokens(
                len(p.token_ids), None if echo_only else 1 if prompt_only else req.max_tokens,
                max_model_len, default=_DEFAULT_MAX_TOKENS,
                cap=self.generation_defaults.max_new_tokens),
            logprobs=req.logprobs, vocab_size=self.tokenizer.vocab_size, max_n=self.config.max_n,
            structured_outputs=structured_outputs, bad_words_token_ids=bad_words_token_ids,
            defaults=self.generation_defaults),
            prompt_logprobs=prompt_logprobs) for p in prompts]
        state = request.state
        salt = request_cache_salt(state.tenant_cache_salt, req.cache_salt)
        out = _CompletionOutput(self, req, prompts, f"cmpl-{response_id(req, request)}")
        if echo_only:
            run = ChoiceRun(prompts, [], static_deltas([
                ChoiceDelta(i, "", 0, None, "length") for i in range(len(prompts) * req.n)]))
        else:
            run = self.start(prompts, sampling, stop=req.stop_list,
                             include_stop_str_in_output=req.include_stop_str_in_output,
                             logprobs=req.logprobs is not None, cache_salt=salt,
                             engine_prefix=state.engine_request_prefix,
                             request_id=state.request_id, guided_param=guided_param,
                             lora_request=lora)
            if prompt_only:
                run = _prompt_only(run)
        return await self.respond(request, run, bool(req.stream), out.build_response,
                                  out.stream_chunks, req.include_usage, out.meta)


class _CompletionOutput:
    """The response (or stream chunks) of one completion request."""

    def __init__(self, serving: CompletionServing, req: CompletionRequest,
                 prompts: list[PromptInput], response_id: str) -> None:
        self.serving, self.req, self.prompts, self.n = serving, req, prompts, req.n
        self.meta = {"id": response_id, "object": "text_completion",
                     "created": int(time.time()), "model": serving.config.served_model_name}
        # OpenAI's text_offset counts from the start of the prompt (with echo, the prompt's
        # own tokens come first, from offset 0).
        self.echo_logprobs = bool(req.echo) and req.logprobs is not None
        # vLLM's: prompt_logprobs, else echo's logprobs (echo computes them) in the response.
        self.num_prompt_logprobs = req.prompt_logprobs if req.prompt_logprobs is not None \
            else req.logprobs if self.echo_logprobs else None
        self.offsets = {i: len(serving.prompt_text(prompts[i // req.n]))
                        if req.logprobs is not None and not self.echo_logprobs else 0
                        for i in range(len(prompts) * req.n)}

    def token_text(self, token_id: int) -> str:
        return token_label(self.serving.tokenizer, token_id,
                           bool(self.req.return_tokens_as_token_ids))

    def _echo(self, index: int) -> str:
        return self.serving.prompt_text(self.prompts[index // self.n]) if self.req.echo else ""

    def build_response(self, run: ChoiceRun, deltas: list[ChoiceDelta]) -> dict:
        choices: dict[int, dict] = {}
        for d in deltas:
            c = choices.get(d.index)
            if c is None:
                c = choices[d.index] = {
                    "index": d.index, "text": self._echo(d.index),
                    "logprobs": self._prompt_logprobs(d) if d.logprobs is not None else None,
                    "finish_reason": None, "stop_reason": None}
                if self.num_prompt_logprobs is not None:
                    c["prompt_logprobs"] = prompt_logprobs_json(
                        self.prompts[d.index // self.n].token_ids, d.prompt_logprobs or [],
                        self.num_prompt_logprobs, self.serving.tokenizer.token_text)
                if self.req.return_token_ids:
                    c["prompt_token_ids"] = self.prompts[d.index // self.n].token_ids
                    c["token_ids"] = []
            c["text"] += d.text
            if self.req.return_token_ids:
                c["token_ids"] += d.token_ids
            if d.logprobs is not None:
                self._add_logprobs(c["logprobs"], d.logprobs, d.index)
            if d.finish_reason is not None:
                c["finish_reason"], c["stop_reason"] = d.finish_reason, d.stop_reason
        return {**self.meta, "choices": [choices[i] for i in sorted(choices)],
                "usage": run.usage()}

    async def stream_chunks(self, run: ChoiceRun, first: ChoiceDelta | None
                            ) -> AsyncIterator[dict]:
        echoed: set[int] = set()
        delta = first
        while delta is not None:
            text = delta.text
            first_of_choice = delta.index not in echoed
            if first_of_choice:
                echoed.add(delta.index)
                text = self._echo(delta.index) + text
            token_ids = self.req.return_token_ids
            if text or delta.logprobs or delta.finish_reason is not None or (
                    token_ids and delta.token_ids):
                lps = None if delta.logprobs is None else self._add_logprobs(
                    self._prompt_logprobs(delta) if first_of_choice else _new_logprobs(),
                    delta.logprobs, delta.index)
                choice = {"index": delta.index, "text": text, "logprobs": lps,
                          "finish_reason": delta.finish_reason,
                          "stop_reason": delta.stop_reason}
                if token_ids:  # vLLM's: the prompt's ids in each choice's first chunk
                    if first_of_choice:
                        choice["prompt_token_ids"] = self.prompts[delta.index // self.n].token_ids
                    choice["token_ids"] = delta.token_ids
                yield {**self.meta, "choices": [choice], **chunk_usage(self.req, run)}
            delta = await anext(run.deltas, None)

    def _prompt_logprobs(self, first: ChoiceDelta) -> dict:
        """A choice's logprobs, starting with its prompt's when echoed (vLLM's format: the
        first prompt token has a null logprob and null top_logprobs).

        Raises:
            GatewayError: 503 when the engine did not return the prompt's logprobs.
        """
        out = _new_logprobs()
        if not self.echo_logprobs:
            return out
        prompt = self.prompts[first.index // self.n].token_ids
        if len(first.prompt_logprobs or ()) != len(prompt) - 1:
            raise GatewayError(f"the engine returned {len(first.prompt_logprobs or ())} prompt "
                               f"logprobs for a {len(prompt)}-token prompt", 503)
        token = self.token_text(prompt[0])
        out["tokens"].append(token)
        out["token_logprobs"].append(None)
        out["top_logprobs"].append(None)
        out["text_offset"].append(self.offsets[first.index])
        self.offsets[first.index] += len(token)
        return self._add_logprobs(out, first.prompt_logprobs or [], first.index)

    def _add_logprobs(self, out: dict, logprobs: list[TokenLogprob], index: int) -> dict:
        token_text = self.token_text
        for lp in logprobs:
            token = token_text(lp.token_id)
            top = {token_text(t): clamp_logprob(v) for t, v in lp.top[:self.req.logprobs]}
            top.setdefault(token, clamp_logprob(lp.logprob))
            out["tokens"].append(token)
            out["token_logprobs"].append(clamp_logprob(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offsets[index])
            self.offsets[index] += len(token)
        return out


def _new_logprobs() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


class _Uncounted:
    """A choice's usage view whose one generated token is dropped (echo-only logprobs)."""

    num_output_tokens = 0
    finish_reason = "length"

    def __init__(self, processor: ChoiceProcessor) -> None:
        self._processor = processor

    @property
    def num_cached_tokens(self) -> int:
        return self._processor.num_cached_tokens


def _prompt_only(run: ChoiceRun) -> ChoiceRun:
    """echo + logprobs with max_tokens 0: each choice's one engine token (run only to get
    the prompt's logprobs) is dropped: no text, no logprobs, not counted; "length"."""
    async def deltas() -> AsyncIterator[ChoiceDelta]:
        async with aclosing(run.deltas) as inner:
            async for d in inner:
                yield ChoiceDelta(d.index, "", 0, [], "length", None, d.prompt_logprobs)

    return ChoiceRun(run.prompts, [_Uncounted(p) for p in run.processors],  # type: ignore[misc]
                     deltas(), started_at=run.started_at)
