"""From an OpenAI request to validated engine sampling params, and the context-length check.

Every refusal is a 400 naming the field. Values are range-checked here (including what
would overflow the proto's int32/int64/float fields), so nothing invalid reaches an engine.
"""

from __future__ import annotations

from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.errors import GatewayError, bad_request
from pdserve.services.gateway.generation_config import GenerationDefaults
from pdserve.services.gateway.protocol import SamplingRequest
from pdserve.services.proto import engine_pb2
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.structured_output.params import StructuredOutputsParams

_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_FLOAT32_MAX = 3.4e38
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1024
"""Most stop_token_ids one request may give (the engine checks each per generated token)."""


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    for t in token_ids:
        if not 0 <= t < vocab_size:
            raise bad_request(f"token id {t} is out of range [0, {vocab_size})", param)


MAX_NUM_BAD_WORDS = 128
"""Most token sequences `bad_words` may tokenize to (vLLM's VLLM_MAX_NUM_BAD_WORDS)."""
MAX_BAD_WORDS_TOTAL_TOKENS = 1024
"""Most tokens in all those sequences together (vLLM's MAX_BAD_WORDS_TOTAL_TOKENS): the
sampler matches them against the output at every step."""


async def tokenize_bad_words(words: list[str] | None, encode) -> list[list[int]] | None:
    """vLLM's `SamplingParams.update_from_tokenizer`: each word tokenized as given (leading
    spaces stripped) and with one leading space; the spaced form is kept only when it
    starts with another token and has as many tokens (a word at the start of the text and
    one in its middle).

    Args:
        encode: `GatewayTokenizer.encode_prompt` (text, add_special_tokens) -> token ids.

    Raises:
        GatewayError: 400 naming bad_words, for an empty word or too many sequences or
            tokens.
    """
    if not words:
        return None
    out: list[list[int]] = []
    for word in words:
        if not word.strip():
            raise bad_request("bad_words must not hold an empty word", "bad_words")
        plain = await encode(word.lstrip(), False)
        spaced = await encode(" " + word.lstrip(), False)
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
        if len(out) > MAX_NUM_BAD_WORDS:
            raise bad_request(f"bad_words tokenize to more than {MAX_NUM_BAD_WORDS} token "
                              f"sequences", "bad_words")
        if sum(map(len, out)) > MAX_BAD_WORDS_TOTAL_TOKENS:
            raise bad_request(f"bad_words tokenize to more than {MAX_BAD_WORDS_TOTAL_TOKENS} "
                              f"tokens", "bad_words")
    return out


def check_logprobs(value: int | None, param: str, max_logprobs: int = MAX_LOGPROBS) -> None:
    if value is not None and not 0 <= value <= max_logprobs:
        raise bad_request(f"{param} must be in [0, {max_logprobs}], got {value}", param)


def check_limits(req: SamplingRequest, config: GatewayConfig) -> None:
    """The size limits of the sampling fields (--max-n, --max-stop-strings, ...).

    Raises:
        GatewayError: 400 naming the field and the limit.
    """
    if not 1 <= req.n <= config.max_n:
        raise bad_request(f"n must be in [1, {config.max_n}], got {req.n}", "n")
    stop = req.stop_list
    if len(stop) > config.max_stop_strings:
        raise bad_request(f"stop has {len(stop)} strings; at most {config.max_stop_strings} "
                          f"are allowed", "stop")
    longest = max(map(len, stop), default=0)
    if longest > config.max_stop_string_length:
        raise bad_request(f"stop strings may have at most {config.max_stop_string_length} "
                          f"characters; one has {longest}", "stop")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"stop_token_ids has {len(req.stop_token_ids)} ids; at most "
                          f"{MAX_STOP_TOKEN_IDS} are allowed", "stop_token_ids")


def truncate_prompt(token_ids: list[int], truncate_prompt_tokens: int | None,
                    max_model_len: int, truncation_side: str | None = None) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: keep N prompt tokens before the context-length check,
    the last N (`truncation_side` "left", the default) or the first N ("right"); -1 means
    N = max_model_len; None keeps everything.

    Raises:
        GatewayError: 400 naming truncate_prompt_tokens when N is 0, < -1 or > max_model_len.
    """
    n = truncate_prompt_tokens
    if n is None:
        return token_ids
    if n == -1:
        n = max_model_len
    if n < 1:  # NOTE: 0 would leave an empty prompt
        raise bad_request(f"truncate_prompt_tokens must be -1 or >= 1, got {n}",
                          "truncate_prompt_tokens")
    if n > max_model_len:
        raise bad_request(f"truncate_prompt_tokens value ({n}) is greater than max_model_len "
                          f"({max_model_len}). Please, select a smaller truncation size.",
                          "truncate_prompt_tokens")
    if n >= len(token_ids):
        return token_ids
    return token_ids[:n] if truncation_side == "right" else token_ids[len(token_ids) - n:]


def resolve_max_tokens(num_prompt_tokens: int, requested: int | None, max_model_len: int, *,
                       default: int | None, param: str = "max_tokens",
                       cap: int | None = None) -> int:
    """The number of tokens to generate; 400 when prompt + output cannot fit the context.

    Args:
        requested: the client's max_tokens (None: `default`, or all the remaining context).
        default: the endpoint's default (16 for completions, None for chat).
        cap: the generation config's `max_new_tokens`: at most that many, whatever was asked
            (vLLM's `get_max_tokens` takes the smallest of the limits it knows).
    """
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_prompt_tokens} input tokens. Please reduce the length of the "
            f"input.", "messages" if param == "max_completion_tokens" else "prompt")
    remaining = max_model_len - num_prompt_tokens
    if requested is None:
        requested = min(default, remaining) if default is not None else remaining
    elif requested > remaining:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"input, {requested} for the completion). Please reduce the length of the input "
            f"or of {param}.", param)
    return requested if cap is None else min(requested, cap)


NO_DEFAULTS = GenerationDefaults()
"""No generation config: OpenAI's and vLLM's own defaults."""


def build_sampling_params(req: SamplingRequest, *, max_tokens: int, logprobs: int | None,
                          vocab_size: int, max_n: int, max_tokens_param: str = "max_tokens",
                          structured_outputs: StructuredOutputsParams | None = None,
                          bad_words_token_ids: list[list[int]] | None = None,
                          defaults: GenerationDefaults = NO_DEFAULTS,
                          ) -> SamplingParams:
    """Validated sampling params (defaults filled in as OpenAI and vLLM do).

    Args:
        max_tokens_param: the request field max_tokens came from (for error messages).
        structured_outputs: the output constraint (services/gateway/structured_outputs.py).
        bad_words_token_ids: `req.bad_words` tokenized (`tokenize_bad_words`).
        defaults: the model's generation config: the values of the sampling fields the
            request leaves unset, and EOS ids added to stop_token_ids unless ignore_eos
            (services/gateway/generation_config.py).
    """
    if not 1 <= req.n <= max_n:
        raise bad_request(f"n must be in [1, {max_n}], got {req.n}", "n")
    if req.seed is not None and not _INT64_MIN <= req.seed <= _INT64_MAX - max_n:
        raise bad_request("seed must fit in a signed 64-bit integer", "seed")
    for name in ("top_k", "min_tokens", "priority"):
        value = getattr(req, name)
        if value is not None and abs(value) > _INT32_MAX:
            raise bad_request(f"{name} is out of range", name)
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(req, name)
        if value is not None and abs(value) > _FLOAT32_MAX:
            raise bad_request(f"{name} is out of range", name)
    stop_token_ids = list(req.stop_token_ids or [])
    check_token_ids(stop_token_ids, vocab_size, "stop_token_ids")
    if not req.ignore_eos:  # vLLM's update_from_generation_config
        stop_token_ids += [i for i in defaults.extra_eos_token_ids
                           if i not in stop_token_ids and 0 <= i < vocab_size]
    logit_bias = parse_logit_bias(req.logit_bias, vocab_size)
    allowed_token_ids = None
    if req.allowed_token_ids is not None:
        if not req.allowed_token_ids:
            raise bad_request("allowed_token_ids must not be empty", "allowed_token_ids")
        check_token_ids(req.allowed_token_ids, vocab_size, "allowed_token_ids")
        allowed_token_ids = sorted(set(req.allowed_token_ids))
    for word in bad_words_token_ids or ():
        check_token_ids(word, vocab_size, "bad_words")
    try:
        return SamplingParams(
            n=req.n,
            temperature=defaults.pick("temperature", req.temperature, 1.0),
            top_p=defaults.pick("top_p", req.top_p, 1.0),
            top_k=defaults.pick("top_k", req.top_k, 0),
            min_p=defaults.pick("min_p", req.min_p, 0.0),
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=defaults.pick("repetition_penalty", req.repetition_penalty,
                                             1.0),
            max_tokens=max_tokens, min_tokens=req.min_tokens, stop_token_ids=stop_token_ids,
            ignore_eos=req.ignore_eos, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens, logit_bias=logit_bias,
            structured_outputs=structured_outputs, priority=req.priority,
            prompt_logprobs=req.prompt_logprobs,
            allowed_token_ids=allowed_token_ids, bad_words_token_ids=bad_words_token_ids)
    except ValueError as e:
        message = str(e)
        if message.startswith("max_tokens "):
            message = max_tokens_param + message.removeprefix("max_tokens")
        raise GatewayError(message, 400, message.split(" ", 1)[0]) from None


MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
"""Most logit_bias entries one request may give (OpenAI documents up to 300 in practice)."""


def parse_logit_bias(value: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"<token id>": bias}) as {token id: bias}, biases clamped to
    [-100, 100] as OpenAI and vLLM do.

    Raises:
        GatewayError: 400 for a key that is not a token id of the vocabulary, or too many.
    """
    if not value:
        return None
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"logit_bias has {len(value)} entries; at most "
                          f"{MAX_LOGIT_BIAS_ENTRIES} are allowed", "logit_bias")
    out: dict[int, float] = {}
    bad: list[str] = []
    for key, bias in value.items():
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if not 0 <= token_id < vocab_size:
            bad.append(key)
            continue
        out[token_id] = max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(bias)))
    if bad:
        raise bad_request(f"logit_bias keys must be token ids in [0, {vocab_size}); got "
                          f"{bad[:5]}", "logit_bias")
    return out


def to_engine_params(sp: SamplingParams, choice: int) -> engine_pb2.SamplingParams:
    """The wire form for choice number `choice` (seed + choice, as vLLM fans out n)."""
    params = engine_pb2.SamplingParams(
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
        presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty, max_tokens=sp.max_tokens or 0,
        min_tokens=sp.min_tokens, stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
        priority=sp.priority)
    if sp.seed is not None:
        params.seed = sp.seed + choice
    if sp.logprobs is not None:
        params.logprobs = sp.logprobs
    if sp.prompt_logprobs is not None:
        params.prompt_logprobs = sp.prompt_logprobs
    if sp.logit_bias:
        params.logit_bias.update(sp.logit_bias)
    if sp.allowed_token_ids:
        params.allowed_token_ids.extend(sp.allowed_token_ids)
    for word in sp.bad_words_token_ids or ():
        params.bad_words_token_ids.add(token_ids=word)
    so = sp.structured_outputs
    if so is not None:
        params.structured_outputs.CopyFrom(engine_pb2.StructuredOutputs(
            json=so.json or "", json_object=so.json_object, regex=so.regex or "",
            choice=list(so.choice or ()), grammar=so.grammar or "",
            structural_tag=so.structural_tag or "",
            disable_any_whitespace=so.disable_any_whitespace))
    return params
