"""Stop strings matched across token boundaries, with held-back text flushed at the end.

Text arrives in pieces (one per token). A piece may end with the start of a stop string
("...TR" when the stop is "TRE"), so the checker holds back the longest suffix that is a
proper prefix of some stop string and releases it once it can no longer start a match:

    emitted text | held (could start a stop string) | new piece
                   ^ every future match starts at or after here

Semantics, the same for any split of the text into pieces: generation stops at the stop
string whose occurrence ENDS first (ties: the one starting first); the output ends before
it, or after it with `include_stop_str_in_output` (then nothing needs holding back, but the
last len(stop) - 1 emitted characters are kept to find matches that straddle pieces).
`flush()` releases the held text when generation ends for any other reason.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    def __init__(self, stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._stop = tuple(dict.fromkeys(stop))
        self._include = include_stop_str_in_output
        self._max_len = max((len(s) for s in self._stop), default=0)
        self._prefixes = {s[:i] for s in self._stop for i in range(1, len(s))}
        self._held = ""
        self._context = ""
        """include mode: the last max_len - 1 emitted characters."""
        self.stop_str: str | None = None
        """The stop string that ended generation, once one has."""

    @property
    def is_stopped(self) -> bool:
        return self.stop_str is not None

    def _find_stop(self, window: str) -> tuple[int, int, str] | None:
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            start = window.find(s)
            if start >= 0:
                key = (start + len(s), start, s)
                if best is None or key[:2] < best[:2]:
                    best = key
        return best

    def _num_held(self, text: str) -> int:
        for k in range(min(self._max_len - 1, len(text)), 0, -1):
            if text[-k:] in self._prefixes:
                return k
        return 0

    def feed(self, text: str, can_stop: bool = True) -> str:
        """Add a piece; returns the text now safe to emit.

        Args:
            text: the new piece.
            can_stop: False until `min_tokens` were generated: matches are not acted on.
        """
        if self.is_stopped or not self._stop:
            return "" if self.is_stopped else text
        base = len(self._context)
        window = self._context + self._held + text
        if can_stop:
            found = self._find_stop(window)
            if found is not None:
                end, start, self.stop_str = found
                self._held = self._context = ""
                return window[base:end] if self._include else window[base:max(start, base)]
        if self._include:
            out = window[base:]
            self._context = window[-(self._max_len - 1):] if self._max_len > 1 else ""
            return out
        pending = window[base:]
        num_held = self._num_held(pending)
        self._held = pending[len(pending) - num_held:]
        return pending[:len(pending) - num_held]

    def flush(self) -> str:
        """Generation ended without a stop string: release the held text."""
        out, self._held = self._held, ""
        return "" if self.is_stopped else out
