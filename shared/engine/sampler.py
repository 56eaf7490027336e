"""Sampler: turns one step's logits into token ids (greedy or random) and their logprobs.

Order of operations (logprobs from the raw logits, as vLLM v1 returns them by default):

    raw logits -> logprobs (fp32 log-softmax, before anything else)
               -> allowed_token_ids, bad_words (-inf outside / at the banned tokens)
               -> min_tokens suppression -> penalties (repetition, then frequency / presence)
               -> logit_bias (added to the (row, token) pairs of every row that has one)
               -> greedy rows: argmax
               -> random rows: temperature -> top-k -> top-p -> min-p -> exponential race

Random rows are drawn with the exponential race (gpt-fast `multinomial_sample_one_no_sync`):
argmax_i p_i / E_i with E_i ~ Exponential(1) picks i with probability p_i / sum(p), needs no
normalized probabilities and no cumulative sum.

Seeded rows are counter-based (the idea of Philox and JAX's keys): the random numbers of a
request's output position k come from a generator seeded with `sample_key(seed, k)`, one
value per vocabulary token, indexed by token id. Nothing is carried from one step to the
next, so the k-th token depends only on (seed, k) and the row's own logits: never on the
batch, the row, the instance, a preemption, or whether earlier tokens were sampled here (a
split prefill -> decode, a failover that continues from the tokens so far).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdserve.shared.engine.sampling_metadata import SamplingMetadata
from pdserve.shared.request import TokenLogprobs

_DEFAULT_NUM_TOP_P_CANDIDATES = 256
_CANDIDATE_GROWTH = 16
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's finalizer (Steele et al. 2014): a bijection of 64-bit ints that mixes
    every input bit into every output bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_key(seed: int, position: int) -> int:
    """The generator seed of a seeded request's output position `position` (0 = the first
    output token): a 64-bit hash of (seed, position), the same in every process.

    NOTE: a CPU torch.Generator (mt19937) keeps the low 32 bits of its seed; they are mixed
    from every bit of both inputs.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))


class SamplerOutput(NamedTuple):
    sampled_token_ids: list[int]
    """One token id per row."""
    logprobs: list[TokenLogprobs | None]
    """Per row; None for rows whose request did not ask for logprobs."""


class Sampler:
    """Samples one token per row; keeps no per-request state (see the module docstring).

    Args:
        seed: seeds the generator shared by unseeded rows (None: nondeterministic).
        num_top_p_candidates: rows with top-p but no top-k first look for their nucleus
            among this many most likely tokens (a cheap top-k instead of a full-vocabulary
            sort) and fall back to the full sort only when the nucleus is larger.
    """

    def __init__(self, seed: int | None = None,
                 num_top_p_candidates: int = _DEFAULT_NUM_TOP_P_CANDIDATES) -> None:
        self.seed = seed
        self.num_top_p_candidates = num_top_p_candidates
        self._default_generators: dict[torch.device, torch.Generator] = {}
        self._keyed_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: [num_reqs, vocab_size] float32, row i for `metadata.request_ids[i]`.
                Not modified.
            metadata: built by `SamplingMetadata.from_requests` for the same rows.

        Returns:
            The sampled token ids and, for rows that asked, their `TokenLogprobs`.
        """
        md = metadata
        assert logits.shape == (md.num_reqs, md.vocab_size), (logits.shape, md.vocab_size)
        if md.is_plain_greedy:
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * md.num_reqs)
        logprobs = _compute_logprobs(logits, md) if md.max_num_logprobs is not None else None
        if md.min_tokens_rows is not None or md.penalties is not None \
                or md.logit_bias_rows is not None or md.allowed_rows is not None \
                or md.bad_words_rows is not None:
            logits = logits.clone()
            apply_allowed_token_ids(logits, md)
            apply_bad_words(logits, md)
            apply_min_tokens(logits, md)
            apply_penalties(logits, md)
            apply_logit_bias(logits, md)
        if md.all_random:
            sampled = torch.empty(md.num_reqs, dtype=torch.int64, device=logits.device)
        else:
            sampled = logits.argmax(dim=-1)
        if md.plain_rows:
            index = torch.tensor(md.plain_rows, device=logits.device)
            temperature = md.temperature[index].unsqueeze(1)
            if len(md.plain_rows) == md.num_reqs:
                x = logits / temperature
            else:
                x = logits[index].div_(temperature)
            sampled[index] = self._race(x, None, md.plain_rows, md)
        if md.truncated_rows:
            index = torch.tensor(md.truncated_rows, device=logits.device)
            sampled[index] = self._sample_truncated(logits, index, md)
        token_ids = sampled.tolist()
        if logprobs is None:
            return SamplerOutput(token_ids, [None] * md.num_reqs)
        return SamplerOutput(token_ids, _gather_logprobs(*logprobs, sampled, token_ids, md))

    def _sample_truncated(self, logits: torch.Tensor, index: torch.Tensor,
                          md: SamplingMetadata) -> torch.Tensor:
        """[num_truncated_rows] int64 tokens of the rows with top-k and/or top-p.

        Each pass keeps every row's `width` most likely tokens (a top-k, not a sort). A row
        with top-p but no top-k whose nucleus is wider than that is redone in the next pass,
        `_CANDIDATE_GROWTH` times wider, up to the whole vocabulary (a full sort). Each row is
        drawn in exactly one pass, so seeded rows stay reproducible.
        """
        rows = md.truncated_rows
        # Raw logits: top-k order does not depend on the temperature; _truncate scales.
        x = logits if len(rows) == md.num_reqs else logits[index]
        temperature, top_k, top_p = md.temperature[index], md.top_k[index], md.top_p[index]
        local = torch.arange(len(rows), device=logits.device)  # pending rows, into `rows`
        sampled = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
        width = md.max_top_k
        if md.has_top_p_without_top_k:
            width = max(width, self.num_top_p_candidates)
        while True:
            width = min(width, md.vocab_size)
            partial = md.has_top_p_without_top_k and width < md.vocab_size
            values, ids, covered = _truncate(x, temperature, top_k, top_p, width,
                                             md.has_top_p, partial)
            # NOTE: a host sync, only when some top-p row has no top-k.
            if not partial or bool(covered.all()):
                sampled[local] = self._race(values, ids, [rows[i] for i in local.tolist()], md)
                return sampled
            done = covered.nonzero().squeeze(1)
            sampled[local[done]] = self._race(
                values[done], ids[done], [rows[i] for i in local[done].tolist()], md)
            todo = (~covered).nonzero().squeeze(1)
            local, x, temperature = local[todo], x[todo], temperature[todo]
            top_k, top_p = top_k[todo], top_p[todo]
            width *= _CANDIDATE_GROWTH

    def _race(self, x: torch.Tensor, ids: torch.Tensor | None, rows: list[int],
              md: SamplingMetadata) -> torch.Tensor:
        """Exponential race over x ([num_rows, width] float32 scaled logits, -inf = dropped).

        `ids` ([num_rows, width] int64) maps columns to token ids; None means column = id.
        Min-p is applied here, after top-k / top-p: p_i / p_max is unchanged by truncation.
        Returns [num_rows] int64 token ids.
        """
        weights = x.sub_(x.amax(dim=-1, keepdim=True)).exp_()  # p_i / p_max
        if md.has_min_p:
            min_p = md.min_p[torch.tensor(rows, device=x.device)]
            weights.masked_fill_(weights < min_p.unsqueeze(1), 0.0)
        draws = self._exponentials(rows, ids, weights.shape, md, x.device)
        winners = weights.div_(draws).argmax(dim=-1)
        return winners if ids is None else ids.gather(1, winners.unsqueeze(1)).squeeze(1)

    def _exponentials(self, rows: list[int], ids: torch.Tensor | None, shape: torch.Size,
                      md: SamplingMetadata, device: torch.device) -> torch.Tensor:
        """[num_rows, width] float32 Exponential(1) draws, as -log(U) with U ~ U[0, 1)
        (~6x faster on CPU than `Tensor.exponential_`, and never 0: no 0/0). Unseeded rows
        draw from the shared generator; a seeded row takes its columns' entries of its
        per-vocabulary draw (module docstring)."""
        uniform = torch.empty(shape, dtype=torch.float32, device=device)
        seeded = [(i, row) for i, row in enumerate(rows) if row in md.seeds]
        if len(seeded) < len(rows):
            uniform.uniform_(generator=self._default_generator(device))
        for i, row in seeded:
            generator = self._keyed_generator(device)
            generator.manual_seed(sample_key(md.seeds[row], md.output_positions[row]))
            per_token = torch.rand(md.vocab_size, generator=generator, device=device)
            uniform[i] = per_token if ids is None else per_token[ids[i]]
        return uniform.log_().neg_()

    def _default_generator(self, device: torch.device) -> torch.Generator:
        generator = self._default_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()
            else:
                generator.manual_seed(self.seed)
            self._default_generators[device] = generator
        return generator

    def _keyed_generator(self, device: torch.device) -> torch.Generator:
        """The generator re-seeded for each seeded row (its state never outlives the row)."""
        generator = self._keyed_generators.get(device)
        if generator is None:
            generator = self._keyed_generators[device] = torch.Generator(device=device)
        return generator


def apply_allowed_token_ids(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """In place: -inf at every token a row with allowed_token_ids may not sample
    ([num_reqs, vocab] float32; vLLM's allowed_token_ids mask)."""
    if metadata.allowed_rows is not None:
        assert metadata.disallowed_mask is not None
        rows = metadata.allowed_rows
        logits[rows] = logits[rows].masked_fill_(metadata.disallowed_mask, float("-inf"))


def apply_bad_words(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """In place: -inf at the (row, token) pairs the rows' bad words ban this step."""
    if metadata.bad_words_rows is not None:
        assert metadata.bad_words_token_ids is not None
        logits.index_put_((metadata.bad_words_rows, metadata.bad_words_token_ids),
                          torch.tensor(float("-inf"), device=logits.device))


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """In place: -inf at EOS / stop ids of rows below min_tokens ([num_reqs, vocab] float32)."""
    if metadata.min_tokens_rows is not None:
        assert metadata.min_tokens_token_ids is not None
        logits.index_put_((metadata.min_tokens_rows, metadata.min_tokens_token_ids),
                          torch.tensor(float("-inf"), device=logits.device))


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """In place: logits[row, token] += bias for every request's logit_bias, one batched
    scatter-add over the (row, token) pairs of the whole batch (pairs are unique)."""
    if metadata.logit_bias_rows is not None:
        assert metadata.logit_bias_token_ids is not None
        assert metadata.logit_bias_values is not None
        logits.index_put_((metadata.logit_bias_rows, metadata.logit_bias_token_ids),
                          metadata.logit_bias_values.to(logits.dtype), accumulate=True)


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """In place, on the penalty rows of logits ([num_reqs, vocab_size] float32).

    Repetition (CTRL, Keskar et al. 2019, as in vLLM): a token seen in the prompt or the
    output has its logit divided by the penalty when positive, multiplied when not.
    Then frequency / presence (OpenAI): logit -= frequency * count + presence * (count > 0),
    counting the output tokens only.
    """
    penalties = metadata.penalties
    if penalties is None:
        return
    vocab_size = logits.shape[1]
    device = logits.device
    # Sparse: each (row, token) pair that occurs becomes one key, row * (vocab + 1) + token,
    # so the padding id (vocab_size) gets keys of its own; only those tokens are touched.
    row_offsets = torch.arange(len(penalties.rows), device=device).unsqueeze(1) * (vocab_size + 1)
    output_keys, output_counts = torch.unique(penalties.output_token_ids + row_offsets,
                                              return_counts=True)
    keys = output_keys
    if penalties.prompt_token_ids is not None:
        keys = torch.unique(torch.cat([(penalties.prompt_token_ids + row_offsets).flatten(),
                                       output_keys]))
    keys = keys[keys % (vocab_size + 1) != vocab_size]  # drop the padding
    local_rows, token_ids = keys // (vocab_size + 1), keys % (vocab_size + 1)
    # count of each key among the outputs (0 for prompt-only tokens)
    pos = torch.searchsorted(output_keys, keys).clamp_(max=len(output_keys) - 1)
    count = torch.where(output_keys[pos] == keys, output_counts[pos], 0).to(logits.dtype)
    rows = torch.tensor(penalties.rows, device=device)[local_rows]
    x = logits[rows, token_ids]
    if penalties.prompt_token_ids is not None:
        repetition = penalties.repetition_penalties[local_rows]
        x = torch.where(x > 0, x / repetition, x * repetition)
    x -= penalties.frequency_penalties[local_rows] * count
    x -= penalties.presence_penalties[local_rows] * (count > 0)
    logits[rows, token_ids] = x  # keys are unique: no duplicate writes


def _truncate(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
              top_p: torch.Tensor, width: int, has_top_p: bool, has_partial_rows: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Temperature, top-k, then top-p, over each row's `width` most likely tokens.

    Args:
        x: [num_rows, vocab] float32 logits (not yet divided by the temperature).
        temperature: [num_rows] float32, > 0.
        top_k: [num_rows] int64, vocab where disabled.
        top_p: [num_rows] float32, 1.0 where disabled.
        width: candidates kept per row; at least every row's top-k.
        has_top_p: some row has top_p < 1.
        has_partial_rows: some row has top_k > width (top-p only, width < vocab): its
            candidates hold only part of its distribution.

    Returns:
        values [num_rows, width] float32 scaled logits (most likely first, -inf where
        dropped), their token ids [num_rows, width] int64, and covered [num_rows] bool:
        False for a row whose nucleus may reach past the candidates (redo it wider).
    """
    if width == x.shape[1]:
        values, ids = x.sort(dim=-1, descending=True)  # faster than a top-k of everything
    else:
        values, ids = x.topk(width, dim=-1)
    values.div_(temperature.unsqueeze(1))
    positions = torch.arange(width, device=x.device)
    values.masked_fill_(positions >= top_k.unsqueeze(1), float("-inf"))
    has_all = top_k <= width  # the candidates hold the row's whole top-k distribution
    if not has_top_p:
        return values, ids, has_all
    log_norm = values.logsumexp(dim=-1)
    if has_partial_rows:
        scaled = x / temperature.unsqueeze(1)
        log_norm = torch.where(has_all, log_norm, scaled.logsumexp(dim=-1))
    probs = (values - log_norm.unsqueeze(1)).exp_()
    cumulative = probs.cumsum(dim=-1)
    # Keep the shortest prefix whose mass reaches top_p: drop a token once the tokens before
    # it already hold top_p. The first token always stays.
    drop = (cumulative - probs >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    values.masked_fill_(drop, float("-inf"))
    return values, ids, has_all | (cumulative[:, -1] >= top_p)


def _compute_logprobs(logits: torch.Tensor, md: SamplingMetadata
                      ) -> tuple[list[int], torch.Tensor, torch.Tensor | None,
                                 torch.Tensor | None]:
    """(rows, fp32 log-softmax of those raw rows [n, vocab], top values, top ids [n, max])."""
    rows = [i for i, n in enumerate(md.num_logprobs) if n is not None]
    if len(rows) == md.num_reqs:
        source = logits
    else:
        source = logits[torch.tensor(rows, device=logits.device)]
    logprobs = torch.log_softmax(source, dim=-1, dtype=torch.float32)
    if not md.max_num_logprobs:
        return rows, logprobs, None, None
    top_values, top_ids = logprobs.topk(md.max_num_logprobs, dim=-1)
    return rows, logprobs, top_values, top_ids


def _gather_logprobs(rows: list[int], logprobs: torch.Tensor, top_values: torch.Tensor | None,
                     top_ids: torch.Tensor | None, sampled: torch.Tensor,
                     token_ids: list[int], md: SamplingMetadata) -> list[TokenLogprobs | None]:
    chosen = sampled[torch.tensor(rows, device=sampled.device)].unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen).squeeze(1).tolist()
    values = top_values.tolist() if top_values is not None else [[] for _ in rows]
    ids = top_ids.tolist() if top_ids is not None else [[] for _ in rows]
    out: list[TokenLogprobs | None] = [None] * md.num_reqs
    for j, row in enumerate(rows):
        n = md.num_logprobs[row]
        assert n is not None
        out[row] = TokenLogprobs(token_id=token_ids[row], logprob=chosen_logprobs[j],
                                 top_token_ids=ids[j][:n], top_logprobs=values[j][:n])
    return out
