"""OpenAI request models (strict JSON types), parsed from raw bytes into GatewayError on failure.

As in vLLM, fields neither the models nor vLLM's request schemas name are accepted and
ignored; fields the OpenAI API or vLLM defines but pdserve does not implement (`suffix`,
`use_beam_search`, images, ...) are refused with a 400 naming the field when set to anything
but a value with no effect (`NOT_IMPLEMENTED`). Types are strict (`"stream": "yes"` and
`"max_tokens": "ten"` are errors) and floats finite (`NaN`, `Infinity`, `1e999` are
errors), so a malformed body is a 400, never a surprise later. The models are also the
request schemas of /openapi.json.
"""

from __future__ import annotations

import re
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from pdserve.services.gateway.errors import GatewayError, bad_request


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """Every non-2xx answer of the gateway (services/gateway/errors.py)."""

    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class NullMeansDefault(OpenAIBaseModel):
    """A request model whose optional fields take null for their default (OpenAI's)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        """OpenAI's API allows null for its optional fields (`n`, `logprobs`, `echo`, ...),
        and vLLM's schema types them Optional: an explicit null means the default here too
        (a required field's null stays an error)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if not (v is None and k in fields and not fields[k].is_required()
                        and fields[k].default is not None)}


class SamplingRequest(NullMeansDefault):
    """Fields both generation endpoints share (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    cache_salt: str | None = None
    allowed_token_ids: list[int] | None = None
    """vLLM's: only these token ids may be generated."""
    bad_words: list[str] | None = None
    """vLLM's: words never generated (services/gateway/sampling.py tokenize_bad_words)."""
    prompt_logprobs: int | None = None
    """vLLM's: the logprobs of every prompt token, with this many alternatives
    (services/gateway/prompt_logprobs.py)."""
    use_beam_search: bool = False
    """vLLM's: n beams instead of n samples (services/gateway/beam_search.py)."""
    length_penalty: float = 1.0
    """vLLM's: beams are ranked by cumulative logprob / length ** length_penalty."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: keep N prompt tokens (-1: max_model_len) before the length check."""
    truncation_side: Literal["left", "right"] | None = None
    """vLLM's: which end truncate_prompt_tokens cuts; "left" (the default) keeps the last N
    tokens, "right" the first N."""
    request_id: str | None = None
    """vLLM's: the response's id is built from it (an X-Request-Id header wins, as in vLLM)."""
    return_token_ids: bool | None = None
    """vLLM's: the response carries `prompt_token_ids` and each choice's `token_ids`."""
    return_tokens_as_token_ids: bool | None = None
    """vLLM's: logprobs name tokens "token_id:<id>" instead of by their text."""
    priority: int = 0
    """vLLM's: lower is served first; only with the engines' --scheduling-policy priority."""
    response_format: dict | None = None
    structured_outputs: dict | None = None
    """vLLM's extra body: json / regex / choice / grammar / json_object / structural_tag."""
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    """vLLM's older field: only "xgrammar" (the one backend) or "auto"; others are refused."""

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: list[int] | list[list[int]] | str | list[str]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ContentPart(OpenAIBaseModel):
    """One part of a message's content. Only "text" is supported (check_content_parts);
    the other OpenAI types parse, so their refusal can name what is missing."""

    type: str
    text: str | None = None


_MEDIA_PARTS = {"image_url": "image", "input_image": "image", "image": "image",
                "image_pil": "image", "image_embeds": "image", "input_audio": "audio",
                "audio_url": "audio", "video_url": "video", "file": "file"}


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    """None only for an assistant message (one that carries tool_calls)."""
    name: str | None = None
    tool_calls: list[dict] | None = None
    """An assistant's calls: [{"id", "type": "function", "function": {"name", "arguments"}}]."""
    tool_call_id: str | None = None
    """A tool message: the call it answers."""

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)


def check_content_parts(messages: list[ChatMessage]) -> None:
    """Refuse content parts other than text (400): this is a text-only model.

    A tool message must name the call it answers (tool_call_id), as OpenAI requires.

    Raises:
        GatewayError: 400, e.g. "image input is not supported by this model".
    """
    for i, message in enumerate(messages):
        if message.role == "tool" and not message.tool_call_id:
            raise bad_request(f"Missing required parameter: 'messages.{i}.tool_call_id'",
                              "messages")
        if message.content is None and message.role != "assistant":
            raise bad_request(f"Invalid value for 'messages.{i}.content': Field required",
                              "messages")
        if message.content is None or isinstance(message.content, str):
            continue
        for j, part in enumerate(message.content):
            where = f"messages.{i}.content.{j}"
            if part.type == "text":
                if part.text is None:
                    raise bad_request(f"Invalid value for '{where}.text': Field required",
                                      "messages")
            elif part.type in _MEDIA_PARTS:
                raise bad_request(f"{_MEDIA_PARTS[part.type]} input is not supported by this "
                                  f"model ({where} has type {part.type!r})", "messages")
            else:
                raise bad_request(f"content part type {part.type!r} is not supported "
                                  f"({where}); use 'text'", "messages")


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    """False: tool_choice "required" makes exactly one call (default: one or more)."""
    echo: bool = False
    """vLLM's: the answer starts with the last message's content when it has the answer's
    role (e.g. with continue_final_message)."""

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else \
            self.max_completion_tokens


class TokenizeRequest(OpenAIBaseModel):
    """/tokenize: either `prompt` (completions) or `messages` (chat), as in vLLM."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


_M = TypeVar("_M", bound=OpenAIBaseModel)
_TYPE_TAG = re.compile(r"str|int|float|bool|dict|\w*\[.*\]")


def parse_request(model_cls: type[_M], body: bytes) -> _M:
    """Parse and type-check a JSON body.

    Raises:
        GatewayError: 400 naming the first offending field.
    """
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)
        err = errors[0]
        if err["type"] == "json_invalid":
            raise bad_request(f"The body is not valid JSON: {err['msg']}") from None
        loc = _field_path(err["loc"])
        if not loc:
            raise bad_request(f"The body must be a JSON object: {err['msg']}") from None
        # A value no branch of a union takes fails once per branch: name them all ("a valid
        # string, or a valid dictionary"), not only the first.
        msgs = list(dict.fromkeys(x["msg"] for x in errors if _field_path(x["loc"]) == loc))
        msg = msgs[0] + "".join(", or " + m.removeprefix("Input should be ") for m in msgs[1:])
        path = ".".join(loc)
        raise GatewayError(f"Invalid value for '{path}': {msg}", 400, loc[0]) from None


def _field_path(loc: tuple) -> list[str]:
    """A validation error's location without the union branches pydantic adds to it as
    type names ("str", "list[int]")."""
    return [str(x) for x in loc if not _TYPE_TAG.fullmatch(str(x))]


_NO_EFFECT = (None,)
NOT_IMPLEMENTED: dict[str, tuple] = {
    # vLLM's sampling fields
    "watermarking": (None, False), "logprob_token_ids": _NO_EFFECT,
    "spaces_between_special_tokens": (None, True), "repetition_detection": _NO_EFFECT,
    "thinking_token_budget": (None, -1),
    # vLLM's extra fields
    "prompt_embeds": _NO_EFFECT, "session_id": _NO_EFFECT,
    "routed_experts_prompt_start": (None, 0), "kv_transfer_params": _NO_EFFECT,
    "ec_transfer_params": _NO_EFFECT, "vllm_xargs": _NO_EFFECT, "stream_interval": _NO_EFFECT,
    "guided_whitespace_pattern": _NO_EFFECT,
}
"""vLLM request fields (vLLM's completion and chat schemas) pdserve does not implement, with
the values that have no effect (their defaults): anything else is a 400 naming the field."""
CHAT_NOT_IMPLEMENTED: dict[str, tuple] = {
    "documents": _NO_EFFECT, "chat_template": _NO_EFFECT,
    "media_io_kwargs": _NO_EFFECT, "mm_processor_kwargs": _NO_EFFECT,
    "reasoning_effort": _NO_EFFECT, "include_reasoning": (None, True),
    "return_prompt_text": (None, False), "add_special_tokens": (None, False),
}
"""The same for vLLM's chat-only fields."""
NO_EFFECT_IN_VLLM = ("user", "return_token_offsets", "return_mm_kwargs", "mm_payload")
"""Accepted with no effect, as in vLLM: OpenAI's `user` ("ignored by vLLM"), and three fields
vLLM honours only on its /render endpoints ("ignored on regular generation endpoints")."""


def check_not_implemented(req: BaseModel, table: dict[str, tuple]) -> None:
    """Raises: GatewayError 400 naming the first field of `table` (name -> the values with no
    effect) that `req` sets to any other value."""
    extra = req.model_extra or {}
    for name, no_effect in table.items():
        value = extra.get(name)
        if not any(value == v and type(value) is type(v) for v in no_effect):
            raise bad_request(f"{name} is not supported by pdserve", name)


def check_unsupported(req: SamplingRequest) -> None:
    """Refuse the OpenAI and vLLM fields pdserve does not implement, naming them
    (`NOT_IMPLEMENTED`, `CHAT_NOT_IMPLEMENTED`).

    Raises:
        GatewayError: 400 naming the first such field set to a value with an effect.
    """
    check_not_implemented(req, {**NOT_IMPLEMENTED, **CHAT_NOT_IMPLEMENTED}
                          if isinstance(req, ChatCompletionRequest) else NOT_IMPLEMENTED)
    if req.length_penalty != 1.0 and not req.use_beam_search:
        raise bad_request("length_penalty needs use_beam_search", "length_penalty")
    if req.guided_decoding_backend not in (None, "xgrammar", "auto"):
        raise bad_request("guided_decoding_backend: the one backend is xgrammar",
                          "guided_decoding_backend")
    if isinstance(req, CompletionRequest) and req.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of different from n is not supported", "best_of")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be set when stream is true",
                          "stream_options")
    if any(s == "" for s in req.stop_list):
        raise bad_request("stop strings must not be empty", "stop")
