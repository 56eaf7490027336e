"""ChoiceProcessor: engine outputs of one choice -> text deltas, finish reason and logprobs.

Tokens are taken one at a time: detokenized incrementally, passed through the stop checker,
and counted. A stop string ends the choice on the token that completed it (later tokens of
the same engine output are dropped, as if never generated). When the engine finishes
(EOS / stop token -> "stop", max_tokens -> "length"), the detokenizer and the stop checker
release what they held. The stop token itself is not detokenized unless
`include_stop_str_in_output` (vLLM's rule), so EOS markers never reach the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.services.gateway.detokenizer import Decoder, IncrementalDetokenizer
from pdserve.services.gateway.errors import GatewayError
from pdserve.services.gateway.prefill_decode import EngineOutput
from pdserve.services.gateway.stop_checker import StopChecker, StopTable
from pdserve.services.proto import engine_pb2
from pdserve.shared.sampling_params import SamplingParams

_FINISH_REASONS = {
    engine_pb2.FINISH_REASON_UNSPECIFIED: None,
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
}


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    """The requested number of most likely (token_id, logprob), most likely first."""
    rank: int | None = None
    """vLLM's rank of token_id (1 = most likely); prompt logprobs only."""


@dataclass(slots=True)
class ChoiceDelta:
    """What one engine output adds to one choice."""

    index: int
    text: str
    num_tokens: int
    logprobs: list[TokenLogprob] | None
    """One per token counted in `num_tokens`; None when not requested."""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the choice (vLLM's extension)."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """First delta only, when the engine returned them: one per prompt token after the
    first (echo with logprobs, or prompt_logprobs)."""
    token_ids: list[int] = field(default_factory=list)
    """The ids of the `num_tokens` tokens (vLLM's `return_token_ids`)."""


class ChoiceProcessor:
    def __init__(self, index: int, decoder: Decoder, prompt_token_ids: Sequence[int],
                 params: SamplingParams, *, stop: StopTable | Sequence[str] = (),
                 include_stop_str_in_output: bool = False, logprobs: bool = False) -> None:
        """`stop`: the request's StopTable, built once and shared by all its choices (or
        the stop strings, compiled for this choice alone)."""
        self.index = index
        self._params = params
        self._detokenizer = IncrementalDetokenizer(decoder, prompt_token_ids,
                                                   params.skip_special_tokens)
        if isinstance(stop, StopTable) and \
                stop.include_stop_str_in_output != include_stop_str_in_output:
            raise ValueError("include_stop_str_in_output differs from the stop table's")
        self._stop_checker = StopChecker(stop, include_stop_str_in_output)
        self._include_stop = include_stop_str_in_output
        self._logprobs = logprobs
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self._first = True

    def process(self, out: EngineOutput) -> ChoiceDelta:
        if self.finish_reason is not None:
            raise RuntimeError(f"choice {self.index} already finished")
        if out.finish_reason == engine_pb2.FINISH_REASON_ABORT:
            raise GatewayError("the engine aborted the request", 503)
        engine_finish = _FINISH_REASONS.get(out.finish_reason)
        if out.num_cached_tokens is not None:
            self.num_cached_tokens = out.num_cached_tokens
        delta = ChoiceDelta(self.index, "", 0, [] if self._logprobs else None)
        if self._first:
            self._first = False
            if out.prompt_logprobs:
                delta.prompt_logprobs = [_token_logprob(lp) for lp in out.prompt_logprobs]
        pieces: list[str] = []
        last = len(out.token_ids) - 1
        for j, token_id in enumerate(out.token_ids):
            self.num_output_tokens += 1
            delta.num_tokens += 1
            delta.token_ids.append(token_id)
            if delta.logprobs is not None and j < len(out.logprobs):
                delta.logprobs.append(_token_logprob(out.logprobs[j], token_id))
            if j == last and engine_finish == "stop" and not self._include_stop:
                break  # the EOS / stop token: counted, never detokenized
            piece = self._detokenizer.step(token_id)
            if piece:
                can_stop = self.num_output_tokens >= self._params.min_tokens
                pieces.append(self._stop_checker.feed(piece, can_stop))
                if self._stop_checker.is_stopped:
                    delta.finish_reason, delta.stop_reason = "stop", self._stop_checker.stop_str
                    break
        if delta.finish_reason is None and engine_finish is not None:
            pieces.append(self._stop_checker.feed(self._detokenizer.flush()))
            if self._stop_checker.is_stopped:
                delta.finish_reason, delta.stop_reason = "stop", self._stop_checker.stop_str
            else:
                pieces.append(self._stop_checker.flush())
                delta.finish_reason, delta.stop_reason = engine_finish, out.stop_reason
        delta.text = "".join(pieces)
        self.finish_reason = delta.finish_reason
        return delta


def _token_logprob(lp: engine_pb2.TokenLogprobs, token_id: int | None = None) -> TokenLogprob:
    return TokenLogprob(lp.token_id if token_id is None else token_id, lp.logprob,
                        list(zip(lp.top_token_ids, lp.top_logprobs)), lp.rank or None)
