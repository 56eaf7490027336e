"""Proto <-> domain conversions shared by the prefill and decode servicers."""

from __future__ import annotations

from pdserve.services.proto import engine_pb2 as pb
from pdserve.shared.kv_transfer.codec import KVLayout
from pdserve.shared.kv_transfer.params import KVHandle
from pdserve.shared.request import FinishReason, TokenLogprobs
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.structured_output.params import StructuredOutputsParams

FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def sampling_params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """Validated SamplingParams. Raises ValueError naming the field.

    NOTE: proto3 cannot tell an unset float from 0, so top_p = 0 and repetition_penalty = 0
    (both invalid values) mean "unset" (1.0), and max_tokens = 0 means "up to max_model_len".
    """
    return SamplingParams(
        temperature=p.temperature, top_p=p.top_p or 1.0, top_k=p.top_k, min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
        max_tokens=p.max_tokens if p.max_tokens != 0 else None,
        min_tokens=p.min_tokens, stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos, logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        logit_bias=dict(p.logit_bias) or None,
        allowed_token_ids=list(p.allowed_token_ids) or None,
        bad_words_token_ids=[list(w.token_ids) for w in p.bad_words_token_ids] or None,
        structured_outputs=structured_outputs_from_proto(p.structured_outputs)
        if p.HasField("structured_outputs") else None, priority=p.priority)


def structured_outputs_from_proto(p: pb.StructuredOutputs) -> StructuredOutputsParams:
    """Raises ValueError naming the field (none or several constraints set, ...)."""
    return StructuredOutputsParams(
        json=p.json or None, json_object=p.json_object, regex=p.regex or None,
        choice=tuple(p.choice) or None, grammar=p.grammar or None,
        structural_tag=p.structural_tag or None,
        disable_any_whitespace=p.disable_any_whitespace)


def logprobs_to_proto(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob,
                            top_token_ids=lp.top_token_ids, top_logprobs=lp.top_logprobs,
                            rank=lp.rank or 0)


def prompt_logprobs_to_proto(prompt_logprobs: list[TokenLogprobs | None] | None
                             ) -> list[pb.TokenLogprobs]:
    """The wire form: one per prompt token after the first (entry 0, None, is dropped).

    Raises:
        ValueError: an entry after the first is missing (the prompt was not fully computed).
    """
    rest = (prompt_logprobs or [])[1:]
    if any(lp is None for lp in rest):
        raise ValueError("prompt_logprobs: the engine left a prompt position without logprobs")
    return [logprobs_to_proto(lp) for lp in rest]  # type: ignore[arg-type]


def handle_to_proto(h: KVHandle) -> pb.KVTransferParams:
    return pb.KVTransferParams(
        prefill_address=h.prefill_address, block_hashes=h.block_hashes, num_tokens=h.num_tokens,
        dtype=h.layout.dtype, num_layers=h.layout.num_layers, block_size=h.layout.block_size,
        num_kv_heads=h.layout.num_kv_heads, head_dim=h.layout.head_dim, model=h.model,
        quantization=h.quantization, lora_name=h.lora_name, lora_int_id=h.lora_int_id)


def handle_from_proto(p: pb.KVTransferParams) -> KVHandle:
    layout = KVLayout(p.num_layers, p.block_size, p.num_kv_heads, p.head_dim, p.dtype)
    return KVHandle(p.prefill_address, list(p.block_hashes), p.num_tokens, layout, p.model,
                    p.quantization or "none", p.lora_name, p.lora_int_id)
