"""POST /v1/chat/completions: marker-safe chat template, boolean logprobs + top_logprobs,
output constraints and tools (services/gateway/tools.py, tool_parsers/)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from pdserve.services.gateway.beam_search import respond_beam_search
from pdserve.services.gateway.errors import bad_request
from pdserve.services.gateway.output_processor import ChoiceDelta, TokenLogprob
from pdserve.services.gateway.prompt_logprobs import check_prompt_logprobs, prompt_logprobs_json
from pdserve.services.gateway.protocol import (
    ChatCompletionRequest,
    check_content_parts,
    check_unsupported,
)
from pdserve.services.gateway.sampling import (
    build_sampling_params,
    check_limits,
    check_logprobs,
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
    token_label,
)
from pdserve.services.gateway.structured_outputs import resolve_structured_outputs
from pdserve.services.gateway.tenancy import request_cache_salt
from pdserve.services.gateway.tool_parsers import ToolCallStream, get_tool_parser
from pdserve.services.gateway.tools import ToolMode, resolve_tool_mode, template_messages

# apply_chat_template's own parameters: template variables may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "sanitize_control_tokens"})


class ChatServing(OpenAIServing):
    route = "/v1/chat/completions"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tool_parser = get_tool_parser(self.config.tool_call_parser)

    async def encode_messages(self, req, tools: list | None = None) -> list[int]:
        """The prompt ids of `req.messages` (also used by /tokenize), with `tools` (the
        request's, for the template) when the request uses them."""
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
        messages = template_messages(req)
        if tools is not None:
            template_kwargs = {**template_kwargs, "tools": tools}
        try:
            return await self.tokenizer.encode_chat(
                messages, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, **template_kwargs)
        except Exception as e:  # the template runs on user input: its failures are a 400
            raise bad_request(f"the chat template could not render the messages: {e}",
                              "messages") from None

    async def create(self, req: ChatCompletionRequest, request: Request) -> Response:
        started = await self.start_chat(req, request)
        if isinstance(started, Response):  # a beam search, answered whole
            return started
        run, out = started
        return await self.respond(request, run, bool(req.stream), out.build_response,
                                  out.stream_chunks, req.include_usage, out.chunk_meta)

    async def start_chat(self, req: ChatCompletionRequest, request: Request
                         ) -> tuple[ChoiceRun, _ChatOutput] | Response:
        """Check `req`, render and tokenize it and start its engine requests: the run and
        what builds its answer (also the Responses API's path, serving_responses.py). A beam
        search is answered here, whole."""
        check_unsupported(req)
        lora = await self.resolve_model(req.model, bool(req.use_beam_search))
        check_limits(req, self.config)
        check_logprobs(req.top_logprobs, "top_logprobs", self.config.max_logprobs)
        check_prompt_logprobs(req, self.config.max_logprobs)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        structured_outputs, guided_param = resolve_structured_outputs(req)
        tool_mode = resolve_tool_mode(
            req, enable_auto_tool_choice=self.config.enable_auto_tool_choice,
            template_renders_tools=self.tokenizer.renders_tools, parser=self.tool_parser)
        if tool_mode is not None and tool_mode.parses_calls and \
                not tool_mode.parser.skip_special_tokens:
            req.skip_special_tokens = False  # the markup is a special token (vLLM's too)
        if tool_mode is not None and tool_mode.structured_outputs is not None:
            if structured_outputs is not None:
                raise bad_request(f"{guided_param} cannot be combined with a tool_choice that "
                                  "forces a tool call", guided_param)
            structured_outputs, guided_param = tool_mode.structured_outputs, "tool_choice"
        await self.check_prompt_chars(sum(len(m.text()) for m in req.messages), "messages")
        prompt = PromptInput(await self.encode_messages(
            req, req.tools if tool_mode is not None else None))
        info = await self.engine.engine_info()
        prompt.token_ids = truncate_prompt(prompt.token_ids, req.truncate_prompt_tokens,
                                           info.max_model_len, req.truncation_side)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = resolve_max_tokens(len(prompt.token_ids), req.requested_max_tokens,
                                        info.max_model_len, default=None, param=param,
                                        cap=self.generation_defaults.max_new_tokens)
        if req.use_beam_search:  # not streamed (check_beam_search)
            return await respond_beam_search(self, req, request, [prompt], [max_tokens],
                                             f"chatcmpl-{response_id(req, request)}")
        sp = build_sampling_params(req, max_tokens=max_tokens,
                                   logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                   vocab_size=self.tokenizer.vocab_size, max_n=self.config.max_n,
                                   max_tokens_param=param, structured_outputs=structured_outputs,
                                   bad_words_token_ids=await tokenize_bad_words(
                                       req.bad_words, self.tokenizer.encode_prompt),
                                   defaults=self.generation_defaults)
        state = request.state
        salt = request_cache_salt(state.tenant_cache_salt, req.cache_salt)
        out = _ChatOutput(self, req, f"chatcmpl-{response_id(req, request)}",
                          tool_mode if tool_mode is not None and tool_mode.parses_calls else None)
        run = self.start([prompt], [sp], stop=req.stop_list,
                         include_stop_str_in_output=req.include_stop_str_in_output,
                         logprobs=req.logprobs, cache_salt=salt,
                         engine_prefix=state.engine_request_prefix, request_id=state.request_id,
                         guided_param=guided_param, lora_request=lora)
        return run, out

    def _entry(self, token_id: int, logprob: float, as_token_ids: bool) -> dict:
        token = token_label(self.tokenizer, token_id, as_token_ids)
        return {"token": token, "logprob": clamp_logprob(logprob),
                "bytes": list(token.encode("utf-8"))}

    def logprobs_content(self, logprobs: list[TokenLogprob], as_token_ids: bool = False
                         ) -> list[dict]:
        """`as_token_ids`: vLLM's return_tokens_as_token_ids ("token_id:<id>" tokens)."""
        return [{**self._entry(lp.token_id, lp.logprob, as_token_ids),
                 "top_logprobs": [self._entry(t, v, as_token_ids) for t, v in lp.top]}
                for lp in logprobs]


class _ChatOutput:
    """The response (or stream chunks) of one chat completion request."""

    def __init__(self, serving: ChatServing, req: ChatCompletionRequest,
                 response_id: str, tool_mode: ToolMode | None = None) -> None:
        """`tool_mode`: set when the answers' tool-call markup becomes `tool_calls`."""
        self.serving, self.req = serving, req
        self.tool_mode = tool_mode
        self.meta = {"id": response_id, "created": int(time.time()),
                     "model": serving.config.served_model_name}
        self.chunk_meta = {**self.meta, "object": "chat.completion.chunk"}
        # vLLM's chat echo: the answer starts with the last message's content when that
        # message has the answer's role (assistant, or the last role without a generation
        # prompt), as with continue_final_message.
        last = req.messages[-1]
        role = "assistant" if req.add_generation_prompt else last.role
        self.echo_text = last.text() if req.echo and last.role == role else ""

    def build_response(self, run: ChoiceRun, deltas: list[ChoiceDelta]) -> dict:
        choices: dict[int, dict] = {}
        for d in deltas:
            c = choices.setdefault(d.index, {
                "index": d.index, "message": {"role": "assistant", "content": ""},
                "logprobs": {"content": []} if d.logprobs is not None else None,
                "finish_reason": None, "stop_reason": None})
            c["message"]["content"] += d.text
            if self.req.return_token_ids:
                c.setdefault("token_ids", []).extend(d.token_ids)
            if d.logprobs is not None:
                c["logprobs"]["content"] += self.serving.logprobs_content(
                    d.logprobs, bool(self.req.return_tokens_as_token_ids))
            if d.finish_reason is not None:
                c["finish_reason"], c["stop_reason"] = d.finish_reason, d.stop_reason
        for c in choices.values():
            if self.tool_mode is not None:
                content, calls = self.tool_mode.parser.extract_tool_calls(
                    c["message"]["content"])
                if calls:
                    c["message"] = {"role": "assistant", "content": content,
                                    "tool_calls": [call.to_dict() for call in calls]}
                    if c["finish_reason"] == "stop":
                        c["finish_reason"] = "tool_calls"
            if self.echo_text:
                c["message"]["content"] = self.echo_text + (c["message"]["content"] or "")
        out = {**self.meta, "object": "chat.completion",
               "choices": [choices[i] for i in sorted(choices)], "usage": run.usage()}
        if self.req.return_token_ids:
            out["prompt_token_ids"] = run.prompts[0].token_ids
        if self.req.prompt_logprobs is not None:  # vLLM's: one list, for the one prompt
            first = next(d for d in deltas if d.index == 0)
            out["prompt_logprobs"] = prompt_logprobs_json(
                run.prompts[0].token_ids, first.prompt_logprobs or [], self.req.prompt_logprobs,
                self.serving.tokenizer.token_text)
        return out

    async def stream_chunks(self, run: ChoiceRun, first: ChoiceDelta | None
                            ) -> AsyncIterator[dict]:
        """A role chunk per choice, then one chunk per delta that carries anything."""
        for i in range(len(run.processors)):
            prompt_ids = {"prompt_token_ids": run.prompts[0].token_ids} \
                if self.req.return_token_ids and i == 0 else {}  # vLLM's: first chunk only
            yield {**self.chunk_meta, "choices": [{
                "index": i, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}], **prompt_ids,
                **chunk_usage(self.req, run)}
        if self.echo_text:
            for i in range(len(run.processors)):
                yield {**self.chunk_meta, "choices": [{
                    "index": i, "delta": {"content": self.echo_text}, "logprobs": None,
                    "finish_reason": None}], **chunk_usage(self.req, run)}
        parsers: dict[int, ToolCallStream] = {}
        delta = first
        while delta is not None:
            finish = delta.finish_reason
            pieces = [{"content": delta.text}] if delta.text else []
            if self.tool_mode is not None:
                if delta.index not in parsers:
                    parsers[delta.index] = self.tool_mode.parser.stream()
                parser = parsers[delta.index]
                pieces = parser.feed(delta.text) if delta.text else []
                if finish is not None:
                    pieces += parser.finish()
                    if finish == "stop" and parser.num_calls:
                        finish = "tool_calls"
            token_ids = self.req.return_token_ids
            if not pieces and (delta.logprobs or finish is not None
                               or (token_ids and delta.token_ids)):
                pieces = [{}]
            for j, piece in enumerate(pieces):
                choice = {"index": delta.index, "delta": piece,
                          "logprobs": None if delta.logprobs is None or j else {
                              "content": self.serving.logprobs_content(
                                  delta.logprobs, bool(self.req.return_tokens_as_token_ids))},
                          "finish_reason": finish if j == len(pieces) - 1 else None}
                if choice["finish_reason"] is not None:
                    choice["stop_reason"] = delta.stop_reason
                if token_ids:
                    choice["token_ids"] = [] if j else delta.token_ids
                yield {**self.chunk_meta, "choices": [choice], **chunk_usage(self.req, run)}
            delta = await anext(run.deltas, None)
