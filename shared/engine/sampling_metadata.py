"""SamplingMetadata: one step's per-row sampling inputs, built from the batch's requests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.shared.request import Request

_SEED_MASK = (1 << 64) - 1


@dataclass(slots=True)
class PenaltyInputs:
    """Penalty inputs for the rows that have a repetition / frequency / presence penalty."""

    rows: list[int]
    """Batch rows that have at least one penalty, ascending."""
    repetition_penalties: torch.Tensor
    """[num_penalty_rows] float32, 1.0 where disabled."""
    frequency_penalties: torch.Tensor
    """[num_penalty_rows] float32, 0.0 where disabled."""
    presence_penalties: torch.Tensor
    """[num_penalty_rows] float32, 0.0 where disabled."""
    prompt_token_ids: torch.Tensor | None
    """[num_penalty_rows, max_prompt_len] int64 padded with vocab_size; None when no row
    has a repetition penalty (only the repetition penalty looks at the prompt)."""
    output_token_ids: torch.Tensor
    """[num_penalty_rows, max(1, max_output_len)] int64 padded with vocab_size."""


@dataclass(slots=True)
class SamplingMetadata:
    """Sampling inputs for one step: row i is `requests[i]` of `from_requests`.

    The per-row tensors cover every row; the row lists split the batch into greedy rows,
    random rows over the whole vocabulary (`plain_rows`) and random rows with top-k and/or
    top-p (`truncated_rows`), so the sampler never has to synchronize to find them.
    """

    request_ids: list[str]
    vocab_size: int
    temperature: torch.Tensor
    """[num_reqs] float32; greedy rows keep their (near-zero) value and are never divided."""
    top_k: torch.Tensor
    """[num_reqs] int64 in [1, vocab_size]; vocab_size where disabled."""
    top_p: torch.Tensor
    """[num_reqs] float32 in (0, 1]; 1.0 where disabled."""
    min_p: torch.Tensor
    """[num_reqs] float32 in [0, 1]; 0.0 where disabled."""
    greedy_rows: list[int]
    plain_rows: list[int]
    """Random rows with neither top-k nor top-p (temperature and min-p only)."""
    truncated_rows: list[int]
    """Random rows with top-k and/or top-p."""
    max_top_k: int
    """Largest top-k among `truncated_rows`; 0 when none of them has one."""
    has_top_p: bool
    """Some truncated row has top-p < 1."""
    has_top_p_without_top_k: bool
    """Some truncated row has top-p but no top-k (its nucleus may span the vocabulary)."""
    has_min_p: bool
    seeds: dict[int, int]
    """Row -> seed, for seeded random rows."""
    output_positions: dict[int, int]
    """Row -> the output position it samples now (its number of output tokens so far), for
    the seeded rows: with the seed, the key of the row's random numbers (sampler.py)."""
    penalties: PenaltyInputs | None
    min_tokens_rows: torch.Tensor | None
    """[num_pairs] int64; with `min_tokens_token_ids`, the (row, token) logits set to -inf
    while a request has fewer than min_tokens outputs (EOS unless ignore_eos, stop ids)."""
    min_tokens_token_ids: torch.Tensor | None
    """[num_pairs] int64."""
    logit_bias_rows: torch.Tensor | None
    """[num_biases] int64; with `logit_bias_token_ids` and `logit_bias_values`, the (row,
    token) logits the requests' logit_bias adds to (None: no row has one)."""
    logit_bias_token_ids: torch.Tensor | None
    """[num_biases] int64, unique per row."""
    logit_bias_values: torch.Tensor | None
    """[num_biases] float32."""
    allowed_rows: torch.Tensor | None
    """[num_allowed_rows] int64: the rows with allowed_token_ids (None: no row has them)."""
    disallowed_mask: torch.Tensor | None
    """[num_allowed_rows, vocab_size] bool, True at the tokens those rows may NOT sample."""
    bad_words_rows: torch.Tensor | None
    """[num_banned] int64; with `bad_words_token_ids`, the (row, token) logits set to -inf
    this step by the requests' bad words (`banned_bad_words_tokens`)."""
    bad_words_token_ids: torch.Tensor | None
    """[num_banned] int64."""
    num_logprobs: list[int | None]
    """Per row: SamplingParams.logprobs (None: no logprobs for that row)."""
    max_num_logprobs: int | None
    """Largest `num_logprobs`; None when no row asks for logprobs."""
    all_greedy: bool
    all_random: bool

    @property
    def num_reqs(self) -> int:
        return len(self.request_ids)

    @property
    def is_plain_greedy(self) -> bool:
        """All rows greedy, with no penalty, min_tokens or logprobs: a bare argmax."""
        return (self.all_greedy and self.penalties is None and self.min_tokens_rows is None
                and self.max_num_logprobs is None and self.logit_bias_rows is None
                and self.allowed_rows is None and self.bad_words_rows is None)

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int,
                      device: torch.device | str,
                      output_offsets: list[int] | None = None) -> SamplingMetadata:
        """Build the metadata for `requests`, one row each, in order.

        Args:
            requests: the requests that sample this step, in logits row order.
            vocab_size: width of the logits; larger top-k values are clamped to it and
                out-of-range stop ids are ignored.
            device: where the tensors go (that of the logits).
            output_offsets: per row, how far past the request's num_output_tokens the row
                samples (speculative decoding scores a request's drafts in several rows);
                None: 0 for every row.
        """
        temperature: list[float] = []
        top_k: list[int] = []
        top_p: list[float] = []
        min_p: list[float] = []
        greedy_rows: list[int] = []
        plain_rows: list[int] = []
        truncated_rows: list[int] = []
        max_top_k = 0
        seeds: dict[int, int] = {}
        output_positions: dict[int, int] = {}
        penalty_rows: list[int] = []
        suppress_rows: list[int] = []
        suppress_ids: list[int] = []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        allowed_rows: list[int] = []
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for row, request in enumerate(requests):
            sp = request.sampling_params
            num_output = request.num_output_tokens
            if output_offsets is not None:
                num_output += output_offsets[row]
            k = min(sp.top_k, vocab_size) if sp.top_k > 0 else vocab_size  # 0, -1: disabled
            temperature.append(sp.temperature)
            top_k.append(k)
            top_p.append(sp.top_p)
            min_p.append(sp.min_p)
            if sp.is_greedy:
                greedy_rows.append(row)
            else:
                if sp.seed is not None:
                    seeds[row] = sp.seed & _SEED_MASK
                    output_positions[row] = num_output
                if k < vocab_size or sp.top_p < 1.0:
                    truncated_rows.append(row)
                    if k < vocab_size:
                        max_top_k = max(max_top_k, k)
                else:
                    plain_rows.append(row)
            if sp.has_penalties:
                penalty_rows.append(row)
            if num_output < sp.min_tokens:
                ids = set(sp.stop_token_ids)
                if request.eos_token_id is not None and not sp.ignore_eos:
                    ids.add(request.eos_token_id)
                for token_id in sorted(i for i in ids if i < vocab_size):
                    suppress_rows.append(row)
                    suppress_ids.append(token_id)
            if sp.logit_bias:
                for token_id, bias in sp.logit_bias.items():
                    if token_id < vocab_size:
                        bias_rows.append(row)
                        bias_ids.append(token_id)
                        bias_values.append(bias)
            if sp.allowed_token_ids:
                allowed_rows.append(row)
            if sp.bad_words_token_ids:
                # NOTE: offset rows (speculative decoding) never have bad words
                # (spec_decode/verification.py can_speculate): output_token_ids is the history.
                for token_id in banned_bad_words_tokens(sp.bad_words_token_ids,
                                                        request.output_token_ids):
                    if token_id < vocab_size:
                        banned_rows.append(row)
                        banned_ids.append(token_id)
        num_logprobs = [r.sampling_params.logprobs for r in requests]
        requested = [n for n in num_logprobs if n is not None]
        return cls(
            request_ids=[r.request_id for r in requests],
            vocab_size=vocab_size,
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
            greedy_rows=greedy_rows,
            plain_rows=plain_rows,
            truncated_rows=truncated_rows,
            max_top_k=max_top_k,
            has_top_p=any(top_p[r] < 1.0 for r in truncated_rows),
            has_top_p_without_top_k=any(top_k[r] == vocab_size for r in truncated_rows),
            has_min_p=any(min_p[r] > 0.0 for r in plain_rows + truncated_rows),
            seeds=seeds,
            output_positions=output_positions,
            penalties=_build_penalties(requests, penalty_rows, vocab_size, device),
            min_tokens_rows=_to_index(suppress_rows, device),
            min_tokens_token_ids=_to_index(suppress_ids, device),
            logit_bias_rows=_to_index(bias_rows, device),
            logit_bias_token_ids=_to_index(bias_ids, device),
            logit_bias_values=torch.tensor(bias_values, dtype=torch.float32, device=device)
            if bias_values else None,
            allowed_rows=_to_index(allowed_rows, device),
            disallowed_mask=_build_disallowed_mask(requests, allowed_rows, vocab_size, device),
            bad_words_rows=_to_index(banned_rows, device),
            bad_words_token_ids=_to_index(banned_ids, device),
            num_logprobs=num_logprobs,
            max_num_logprobs=max(requested) if requested else None,
            all_greedy=len(greedy_rows) == len(requests),
            all_random=not greedy_rows,
        )


def banned_bad_words_tokens(bad_words_token_ids: list[list[int]],
                            output_token_ids: list[int]) -> list[int]:
    """The token ids the bad words ban at the next position, sorted and unique (vLLM's
    `apply_bad_words`): a one-token word's token always; a longer word's last token when
    the output so far ends with the word's other tokens. Only output tokens count (a word
    that starts in the prompt is not matched), as in vLLM.
    """
    banned: set[int] = set()
    num_output = len(output_token_ids)
    for word in bad_words_token_ids:
        prefix_len = len(word) - 1
        if prefix_len > num_output:
            continue
        if prefix_len == 0 or output_token_ids[num_output - prefix_len:] == word[:-1]:
            banned.add(word[-1])
    return sorted(banned)


def _build_disallowed_mask(requests: list[Request], rows: list[int], vocab_size: int,
                           device: torch.device | str) -> torch.Tensor | None:
    if not rows:
        return None
    mask = torch.ones(len(rows), vocab_size, dtype=torch.bool, device=device)
    local: list[int] = []
    ids: list[int] = []
    for i, row in enumerate(rows):
        allowed = [t for t in requests[row].sampling_params.allowed_token_ids or ()
                   if t < vocab_size]
        local += [i] * len(allowed)
        ids += allowed
    if ids:
        mask[torch.tensor(local, device=device), torch.tensor(ids, device=device)] = False
    return mask


def _to_index(values: list[int], device: torch.device | str) -> torch.Tensor | None:
    return torch.tensor(values, dtype=torch.int64, device=device) if values else None


def _build_penalties(requests: list[Request], rows: list[int], vocab_size: int,
                     device: torch.device | str) -> PenaltyInputs | None:
    if not rows:
        return None
    params = [requests[r].sampling_params for r in rows]
    repetition = [sp.repetition_penalty for sp in params]
    prompts = None
    if any(p != 1.0 for p in repetition):
        prompts = _pad_token_ids([requests[r].prompt_token_ids for r in rows], vocab_size)
    outputs = _pad_token_ids([requests[r].output_token_ids for r in rows], vocab_size)
    return PenaltyInputs(
        rows=rows,
        repetition_penalties=torch.tensor(repetition, dtype=torch.float32, device=device),
        frequency_penalties=torch.tensor([sp.frequency_penalty for sp in params],
                                         dtype=torch.float32, device=device),
        presence_penalties=torch.tensor([sp.presence_penalty for sp in params],
                                        dtype=torch.float32, device=device),
        prompt_token_ids=None if prompts is None else prompts.to(device),
        output_token_ids=outputs.to(device),
    )


def _pad_token_ids(token_ids: list[list[int]], pad_id: int) -> torch.Tensor:
    """[len(token_ids), max(1, longest)] int64, each row's ids then `pad_id`."""
    width = max(1, max(len(ids) for ids in token_ids))
    return torch.tensor([ids + [pad_id] * (width - len(ids)) for ids in token_ids],
                        dtype=torch.int64)
