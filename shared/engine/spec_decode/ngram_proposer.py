"""NgramProposer: prompt-lookup drafts, copied from the sequence's own earlier tokens.

The longest suffix of the sequence (prompt_lookup_max tokens, down to prompt_lookup_min)
that occurred earlier is looked up; the tokens that followed its most recent earlier
occurrence are the drafts:

    tokens:  ... [a b c] d e f ... x y [a b c]      suffix n-gram "a b c" (n = 3)
                         ^^^^^ drafts: d e f (at most k)

Drafts are one-hot proposals: the verifier needs no draft probabilities
(`shared/engine/spec_decode/verification.py`).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pdserve.shared.engine.spec_decode.config import SpeculativeConfig
from pdserve.shared.request import Request


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int], max_num_drafts: int | None = None) -> list[int]:
        """Up to min(k, max_num_drafts) draft tokens to follow `token_ids`; [] when no
        suffix n-gram of length in [prompt_lookup_min, prompt_lookup_max] occurred before.

        Cost: O(len(token_ids) * prompt_lookup_max) vectorised compares.
        """
        k = self.k if max_num_drafts is None else min(self.k, max_num_drafts)
        num_tokens = len(token_ids)
        if k <= 0 or num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            # Windows that end before the last token, so something follows each match.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the most recent earlier occurrence
                return tokens[start:start + k].tolist()
        return []

    def propose_requests(self, requests: list[Request], max_num_drafts: list[int]
                         ) -> list[list[int]]:
        """`propose` for each request (the batch interface of every proposer)."""
        return [self.propose(r.all_token_ids, m) for r, m in zip(requests, max_num_drafts)]

    def remove_requests(self, request_ids: list[str]) -> None:
        """Nothing to free: the n-gram proposer keeps no per-request state."""
