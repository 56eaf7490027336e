"""POST /v1/chat/completions: marker-safe chat template, boolean logprobs + top_logprobs."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from services.gateway.errors import bad_request
from services.gateway.output_processor import ChoiceDelta, TokenLogprob
from services.gateway.protocol import (
    ChatCompletionRequest,
    check_content_parts,
    check_unsupported,
)
from services.gateway.sampling import (
    build_sampling_params,
    check_limits,
    check_logprobs,
    resolve_max_tokens,
)
from services.gateway.serving_base import ChoiceRun, OpenAIServing, PromptInput, clamp_logprob
from services.gateway.structured_outputs import resolve_structured_outputs
from services.gateway.tenancy import request_cache_salt

# apply_chat_template's own parameters: template variables may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "sanitize_control_tokens"})


class ChatServing(OpenAIServing):
    route = "/v1/chat/completions"

    async def encode_messages(self, req) -> list[int]:
        """The prompt ids of `req.messages` (also used by /tokenize)."""
        if not req.messages:
            raise bad_request("messages must not be empty", "messages")
        check_content_parts(req.messages)
        if req.add_generation_prompt and req.continue_final_message:
            raise bad_request("continue_final_message and add_generation_prompt cannot both "
                              "be true", "continue_final_message")
        if req.continue_final_message and req.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs a final assistant message",
                              "continue_final_message")
        template_kwargs = req.chat_template_kwargs or {}
        reserved = _RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs)
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {sorted(reserved)}",
                              "chat_template_kwargs")
        try:
            return await self.tokenizer.encode_chat(
                [{"role": m.role, "content": m.text()} for m in req.messages],
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, **template_kwargs)
        except Exception as e:  # the template runs on user input: its failures are a 400
            raise bad_request(f"the chat template could not render the messages: {e}",
                              "messages") from None

    async def create(self, req: ChatCompletionRequest, request: Request) -> Response:
        check_unsupported(req)
        self.check_model(req.model)
        check_limits(req, self.config)
        check_logprobs(req.top_logprobs, "top_logprobs", self.config.max_logprobs)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        structured_outputs, guided_param = resolve_structured_outputs(req)
        await self.check_prompt_chars(sum(len(m.text()) for m in req.messages), "messages")
        prompt = PromptInput(await self.encode_messages(req))
        info = await self.engine.engine_info()
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = resolve_max_tokens(len(prompt.token_ids), req.requested_max_tokens,
                                        info.max_model_len, default=None, param=param)
        sp = build_sampling_params(req, max_tokens=max_tokens,
                                   logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                   vocab_size=self.tokenizer.vocab_size, max_n=self.config.max_n,
                                   max_tokens_param=param, structured_outputs=structured_outputs)
        state = request.state
        salt = request_cache_salt(state.tenant_cache_salt, req.cache_salt)
        out = _ChatOutput(self, req, f"chatcmpl-{state.request_id}")
        run = self.start([prompt], [sp], stop=req.stop_list,
                         include_stop_str_in_output=req.include_stop_str_in_output,
                         logprobs=req.logprobs, cache_salt=salt,
                         engine_prefix=state.engine_request_prefix, request_id=state.request_id,
                         guided_param=guided_param)
        return await self.respond(request, run, bool(req.stream), out.build_response,
                                  out.stream_chunks, req.include_usage, out.chunk_meta)

    def _entry(self, token_id: int, logprob: float) -> dict:
        token = self.tokenizer.token_text(token_id)
        return {"token": token, "logprob": clamp_logprob(logprob),
                "bytes": list(token.encode("utf-8"))}

    def logprobs_content(self, logprobs: list[TokenLogprob]) -> list[dict]:
        return [{**self._entry(lp.token_id, lp.logprob),
                 "top_logprobs": [self._entry(t, v) for t, v in lp.top]} for lp in logprobs]


class _ChatOutput:
    """The response (or stream chunks) of one chat completion request."""

    def __init__(self, serving: ChatServing, req: ChatCompletionRequest,
                 response_id: str) -> None:
        self.serving = serving
        self.meta = {"id": response_id, "created": int(time.time()),
                     "model": serving.config.served_model_name}
        self.chunk_meta = {**self.meta, "object": "chat.completion.chunk"}
        self.usage_key = {"usage": None} if req.include_usage else {}

    def build_response(self, run: ChoiceRun, deltas: list[ChoiceDelta]) -> dict:
        choices: dict[int, dict] = {}
        for d in deltas:
            c = choices.setdefault(d.index, {
                "index": d.index, "message": {"role": "assistant", "content": ""},
                "logprobs": {"content": []} if d.logprobs is not None else None,
                "finish_reason": None, "stop_reason": None})
            c["message"]["content"] += d.text
            if d.logprobs is not None:
                c["logprobs"]["content"] += self.serving.logprobs_content(d.logprobs)
            if d.finish_reason is not None:
                c["finish_reason"], c["stop_reason"] = d.finish_reason, d.stop_reason
        return {**self.meta, "object": "chat.completion",
                "choices": [choices[i] for i in sorted(choices)], "usage": run.usage()}

    async def stream_chunks(self, run: ChoiceRun, first: ChoiceDelta | None
                            ) -> AsyncIterator[dict]:
        """A role chunk per choice, then one chunk per delta that carries anything."""
        for i in range(len(run.processors)):
            yield {**self.chunk_meta, "choices": [{
                "index": i, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}], **self.usage_key}
        delta = first
        while delta is not None:
            if delta.text or delta.logprobs or delta.finish_reason is not None:
                choice = {"index": delta.index,
                          "delta": {"content": delta.text} if delta.text else {},
                          "logprobs": None if delta.logprobs is None else {
                              "content": self.serving.logprobs_content(delta.logprobs)},
                          "finish_reason": delta.finish_reason}
                if delta.finish_reason is not None:
                    choice["stop_reason"] = delta.stop_reason
                yield {**self.chunk_meta, "choices": [choice], **self.usage_key}
            delta = await anext(run.deltas, None)
