"""OpenAIServing: what the completions and chat endpoints share.

Fan-out (`n` choices per prompt, seeds seed+i, engine ids `<prefix>-<choice index>`),
admission to the waiting queue (services/gateway/admission.py; every exit path releases it),
waiting for the first output before answering (so a refusal by the engine is still a plain
JSON error with its own status, also for `stream: true`), SSE framing and usage.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.services.gateway.admission import AdmissionQueue, Grant
from pdserve.services.gateway.backpressure import TRANSPORT_KEY, StreamBacklog
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.errors import GatewayError, bad_request, model_not_found
from pdserve.services.gateway.failover import EngineClient
from pdserve.services.gateway.generation_config import load_generation_defaults
from pdserve.services.gateway.lora import LoRAView
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.output_processor import ChoiceDelta, ChoiceProcessor
from pdserve.services.gateway.placement import PromptHashes
from pdserve.services.gateway.prefill_decode import EngineOutput
from pdserve.services.gateway.sampling import to_engine_params
from pdserve.services.gateway.shutdown import ServerShutdown, ShutdownNotice
from pdserve.services.gateway.stop_checker import StopTable
from pdserve.services.gateway.streams import merge_streams, run_until_disconnect
from pdserve.services.gateway.structured_outputs import name_param
from pdserve.services.gateway.tokenization import GatewayTokenizer
from pdserve.shared.lora.request import LoRARequest
from pdserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM clamps the same way)
_HOPELESS = 4


@dataclass(slots=True)
class PromptInput:
    token_ids: list[int]
    text: str | None = None
    """The prompt as text, when echo or text offsets need it."""


@dataclass(slots=True)
class ChoiceRun:
    """The running choices of one HTTP request."""

    prompts: list[PromptInput]
    processors: list[ChoiceProcessor]
    deltas: AsyncIterator[ChoiceDelta]
    grant: Grant | None = None
    """The run's place in the waiting queue (None: no engine request was started)."""
    started_at: float = 0.0
    """time.monotonic() when the engine requests were started."""
    first_token_at: float | None = None
    """time.monotonic() of the run's first output (None: none yet)."""

    async def close(self) -> None:
        """Stop every choice still running and leave the queue (idempotent)."""
        try:
            await self.deltas.aclose()  # type: ignore[attr-defined]
        finally:
            if self.grant is not None:
                self.grant.release()

    def usage(self) -> dict:
        n = len(self.processors) // max(len(self.prompts), 1)
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion_tokens = sum(p.num_output_tokens for p in self.processors)
        cached = sum(max((p.num_cached_tokens for p in self.processors[i * n:(i + 1) * n]),
                         default=0) for i in range(len(self.prompts)))
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}


def chunk_usage(req, run: ChoiceRun) -> dict:
    """The `usage` key of a content chunk (vLLM's rules): absent without
    `stream_options.include_usage`; null with it; the running usage (prompt tokens and the
    tokens generated so far) with `continuous_usage_stats` too."""
    if not req.include_usage:
        return {}
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    return {"usage": run.usage() if continuous else None}


def response_id(req, request: Request) -> str:
    """The id a response is named after (vLLM's `_base_request_id`): the X-Request-Id header,
    else the body's `request_id`, else the one the gateway minted."""
    if req.request_id is not None and "x-request-id" not in request.headers:
        return req.request_id
    return request.state.request_id


def token_label(tokenizer: GatewayTokenizer, token_id: int, as_token_id: bool) -> str:
    """A token as logprobs show it: its text, or "token_id:<id>" (vLLM's
    return_tokens_as_token_ids, for tokens whose text is not valid UTF-8 on its own)."""
    return f"token_id:{token_id}" if as_token_id else tokenizer.token_text(token_id)


def clamp_logprob(value: float) -> float:
    return value if value >= _MIN_LOGPROB else _MIN_LOGPROB  # also maps NaN


def sse_event(data: dict | str) -> str:
    if isinstance(data, str):
        return f"data: {data}\n\n"
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def static_deltas(deltas: Sequence[ChoiceDelta]) -> AsyncIterator[ChoiceDelta]:
    for d in deltas:
        yield d


async def _run_choice(grant: Grant, index: int, processor: ChoiceProcessor,
                      outputs: AsyncIterator[EngineOutput]) -> AsyncIterator[ChoiceDelta]:
    """One choice's deltas, moving it from waiting to running to done in `grant`; stops the
    engine (closes `outputs`) as soon as the processor finishes the choice."""
    try:
        async for out in outputs:
            delta = processor.process(out)
            grant.start(index)
            yield delta
            if delta.finish_reason is not None:
                return
    finally:
        grant.finish(index)
        await outputs.aclose()  # type: ignore[attr-defined]


class _RunStreamingResponse(StreamingResponse):
    """A StreamingResponse that writes its run's events through a bounded backlog
    (backpressure.py) and closes the run however the response ends (also when the client is
    gone before the body iterator ever started)."""

    def __init__(self, backlog: StreamBacklog, run: ChoiceRun, **kwargs) -> None:
        super().__init__(backlog.chunks(), **kwargs)
        self.backlog = backlog
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.backlog.start()
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.backlog.close()
            finally:
                await self.run.close()


def _max_token_chars(tokenizer) -> int | None:
    """An upper bound on the characters one token covers, or None when not known.

    A BPE tokenizer without a normalizer maps every token to at most len(token string)
    characters of text (byte-level strings carry one character per byte), so text of c
    characters has at least c / bound tokens.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None or \
            type(backend.model).__name__ != "BPE":
        return None
    return max(map(len, tokenizer.get_vocab()), default=0) or None


class OpenAIServing:
    route = ""

    def __init__(self, config: GatewayConfig, engine: EngineClient,
                 tokenizer: GatewayTokenizer, metrics: GatewayMetrics,
                 admission: AdmissionQueue | None = None,
                 shutdown: ShutdownNotice | None = None, lora: LoRAView | None = None) -> None:
        """`admission`: the waiting queue the endpoints share (default: one of their own).
        `shutdown`: tells when the grace period of a shutdown ends (shutdown.py). `lora`: the
        cluster's LoRA adapters (None: `model` names the base model only)."""
        self.config = config
        self.lora = lora
        self.shutdown = shutdown or ShutdownNotice()
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.admission = admission or AdmissionQueue(config.max_num_queued_requests,
                                                     config.max_queued_tokens)
        self._max_token_chars = _max_token_chars(tokenizer.tokenizer)
        self.generation_defaults = load_generation_defaults(
            config.generation_config, config.model_path, tokenizer.eos_token_id)
        """The model's generation config: defaults of unset sampling fields, extra EOS ids."""

    async def check_prompt_chars(self, num_chars: int, param: str,
                                 max_model_len: int | None = None) -> None:
        """Refuse, before tokenizing it, text sure to have over _HOPELESS x the context's
        tokens (megabytes of prompt would hold the tokenizer thread for seconds). Text
        nearer the limit is tokenized, so its refusal can state the exact count.

        Args:
            num_chars: the characters of ALL the request's prompts together (they are
                tokenized one after the other on the gateway's one tokenizer thread).
            max_model_len: the context, tokens (default: the engines').

        Raises:
            GatewayError: 400 naming `param` ("prompt" or "messages").
        """
        bound = self._max_token_chars
        if bound is None or num_chars <= bound:
            return
        if max_model_len is None:
            max_model_len = (await self.engine.engine_info()).max_model_len
        if num_chars // bound >= _HOPELESS * max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your input of {num_chars} characters has at least {num_chars // bound} "
                f"tokens. Please reduce the length of the input.", param)

    def check_model(self, model: str | None) -> None:
        """The served model, or a LoRA adapter the cluster had loaded when last seen
        (tokenization: same tokenizer); else vLLM's 404."""
        if model is not None and model != self.config.served_model_name and \
                (self.lora is None or not self.lora.is_known(model)):
            raise model_not_found(model)

    async def resolve_model(self, model: str | None,
                            use_beam_search: bool = False) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model). Raises GatewayError: 404
        (vLLM's) for an unknown model, 400 for beam search under an adapter."""
        if self.lora is None:
            self.check_model(model)
            return None
        lora = await self.lora.resolve(model)
        if lora is not None and use_beam_search:
            raise bad_request("use_beam_search is not supported with a LoRA adapter",
                              "use_beam_search")
        return lora

    def start(self, prompts: list[PromptInput], sampling: list[SamplingParams], *,
              stop: list[str], include_stop_str_in_output: bool, logprobs: bool,
              cache_salt: str | None, engine_prefix: str, request_id: str,
              guided_param: str | None = None,
              lora_request: LoRARequest | None = None) -> ChoiceRun:
        """Start n engine requests per prompt; choice index = prompt index * n + i.

        `guided_param`: the request field the output constraint came from (an engine's 400,
        the constraint does not compile, names it). `lora_request`: the adapter
        (`resolve_model`), None for the base model.

        Raises:
            QueueFullError: 429, the waiting queue cannot take them now (nothing started).
            GatewayError: 400, they could never fit the queue.
        """
        stop_table = StopTable(stop, include_stop_str_in_output)  # shared by every choice
        grant = self.admission.admit([len(prompt.token_ids) + (sp.max_tokens or 0)
                                      for prompt, sp in zip(prompts, sampling, strict=True)
                                      for _ in range(sp.n)])
        processors, streams = [], []
        for p, (prompt, sp) in enumerate(zip(prompts, sampling, strict=True)):
            prompt_hashes = PromptHashes(prompt.token_ids)  # once for its n choices
            for i in range(sp.n):
                index = p * sp.n + i
                proc = ChoiceProcessor(
                    index, self.tokenizer, prompt.token_ids, sp, stop=stop_table,
                    include_stop_str_in_output=include_stop_str_in_output, logprobs=logprobs)
                processors.append(proc)
                streams.append(_run_choice(grant, index, proc, self.engine.generate(
                    f"{engine_prefix}-{index}", prompt.token_ids, to_engine_params(sp, i),
                    cache_salt=cache_salt, request_id=request_id, lora_request=lora_request,
                    engine_prefix=engine_prefix, prompt_hashes=prompt_hashes)))
        for sp in sampling:
            self.metrics.request_params_n.observe(sp.n)
            for _ in range(sp.n):
                self.metrics.request_params_max_tokens.observe(sp.max_tokens or 0)
        deltas = merge_streams(streams)
        if guided_param is not None:
            deltas = name_param(deltas, guided_param)
        return ChoiceRun(prompts, processors, deltas, grant, started_at=time.monotonic())

    def _observe_ttft(self, request: Request, run: ChoiceRun) -> None:
        run.first_token_at = now = time.monotonic()
        self.metrics.time_to_first_token.labels(self.route).observe(
            now - request.state.arrival_time)

    def _count_tokens(self, run: ChoiceRun, request: Request) -> None:
        """The request-level figures, once the run ended (however it ended)."""
        m, now = self.metrics, time.monotonic()
        usage = run.usage()
        m.prompt_tokens.inc(usage["prompt_tokens"])
        m.generation_tokens.inc(usage["completion_tokens"])
        for prompt in run.prompts:
            m.request_prompt_tokens.observe(len(prompt.token_ids))
        for p in run.processors:
            m.request_generation_tokens.observe(p.num_output_tokens)
            m.request_success.labels(p.finish_reason or "abort").inc()
        m.request_max_num_generation_tokens.observe(
            max((p.num_output_tokens for p in run.processors), default=0))
        m.request_queue_time.observe(max(0.0, run.started_at - request.state.arrival_time))
        m.request_inference_time.observe(now - run.started_at)
        if run.first_token_at is not None:
            m.request_prefill_time.observe(run.first_token_at - run.started_at)
            m.request_decode_time.observe(now - run.first_token_at)

    async def respond(self, request: Request, run: ChoiceRun, stream: bool,
                      build_response: Callable[[ChoiceRun, list[ChoiceDelta]], dict],
                      stream_chunks: Callable[[ChoiceRun, ChoiceDelta | None],
                                              AsyncIterator[dict]],
                      include_usage: bool, chunk_meta: dict,
                      frame: Callable[[dict], str] = sse_event, done: bool = True) -> Response:
        """Collect (non-streamed) or stream the choices; aborts them if the client leaves.

        `stream_chunks(run, first)` yields the chunk payloads of a stream that starts with
        the delta `first`; the usage chunk and [DONE] (unless not `done`) are added here,
        every payload and error object written by `frame`. However it ends, the run's
        choices are stopped and its place in the waiting queue is released.
        """
        if not stream:
            try:
                deltas = await self._until_cut(request, run_until_disconnect(
                    request.receive, self._collect(request, run)))
            finally:
                await run.close()
            self._count_tokens(run, request)
            return JSONResponse(build_response(run, deltas))
        try:
            first = await self._until_cut(request, run_until_disconnect(
                request.receive, anext(run.deltas, None)))
        except BaseException:
            await run.close()
            raise
        if first is not None:
            self._observe_ttft(request, run)

        async def events() -> AsyncIterator[str]:
            try:
                async for chunk in self.shutdown.until_cut(stream_chunks(run, first)):
                    yield frame(chunk)
                if include_usage:
                    yield sse_event({**chunk_meta, "choices": [], "usage": run.usage()})
            except ServerShutdown as e:
                request.state.cut_by_shutdown = True
                logger.info("[%s] stream cut: the shutdown's grace period ended",
                            request.state.request_id)
                yield frame(e.to_dict())
            except GatewayError as e:
                yield frame(e.to_dict())
            except Exception:
                logger.exception("[%s] stream failed", request.state.request_id)
                yield frame(GatewayError("internal error", 500).to_dict())
            finally:
                await run.close()
                self._count_tokens(run, request)
            if done:
                yield sse_event("[DONE]")

        def on_cut() -> None:
            request.state.cut_slow_client = True
            self.metrics.streams_cut_slow_client.inc()

        config = self.config
        pause = None if not config.stream_pause_bytes else dict(
            set_paused=functools.partial(self.engine.channels.set_paused,  # (paused)
                                         request.state.engine_request_prefix,
                                         request_id=request.state.request_id),
            pause_at=config.stream_pause_bytes, resume_at=config.stream_resume_bytes,
            max_pause_s=config.max_stream_pause_s, on_pause=self.metrics.streams_paused.inc)
        transport = request.scope.get("extensions", {}).get(TRANSPORT_KEY)
        backlog = StreamBacklog(events(), config.max_stream_backlog, on_cut, transport, pause)
        return _RunStreamingResponse(backlog, run, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

    async def _until_cut(self, request: Request, awaitable):
        """`awaitable`'s result; ServerShutdown (503) when the grace period ends first."""
        try:
            return await self.shutdown.race(awaitable)
        except ServerShutdown:
            request.state.cut_by_shutdown = True
            raise

    async def _collect(self, request: Request, run: ChoiceRun) -> list[ChoiceDelta]:
        deltas = []
        async for d in run.deltas:
            if not deltas:
                self._observe_ttft(request, run)
            deltas.append(d)
        return deltas
