"""StructuredOutputRequest: one guided request's grammar matcher (lives on its `Request`)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class StructuredOutputRequest:
    """The matcher of one request, advanced with each token the request accepts.

    Args:
        request_id: for log lines.
        matcher: an xgrammar `GrammarMatcher` (or a test fake with `accept_token`,
            `fill_next_token_bitmask` and `is_terminated`).
    """

    __slots__ = ("request_id", "matcher", "is_failed", "num_accepted")

    def __init__(self, request_id: str, matcher: Any) -> None:
        self.request_id = request_id
        self.matcher = matcher
        self.is_failed = False
        """A sampled token the grammar refused (e.g. every token was masked by min_tokens):
        the request stops, rather than decode on outside the grammar."""
        self.num_accepted = 0

    def replay(self, token_ids: list[int]) -> None:
        """Rebuild the state from tokens already accepted elsewhere (the prefill's first
        token on the decode side, every token so far after a failover).

        Raises:
            ValueError: a token the grammar does not accept there.
        """
        for i, token_id in enumerate(token_ids):
            if not self.matcher.accept_token(token_id):
                raise ValueError(f"output_token_ids: token {token_id} at position {i} does "
                                 "not match the request's structured output grammar")
            self.num_accepted += 1

    def accept(self, token_id: int) -> None:
        """Advance with this step's sampled token."""
        if self.is_failed or self.matcher.is_terminated():
            return
        if self.matcher.accept_token(token_id):
            self.num_accepted += 1
            return
        self.is_failed = True
        logger.warning("[%s] sampled token %d does not match the grammar after %d tokens; "
                       "stopping the request", self.request_id, token_id, self.num_accepted)

    def fill_bitmask(self, bitmask, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """The grammar is done (its stop token was accepted), or a token broke it."""
        return self.is_failed or self.matcher.is_terminated()
