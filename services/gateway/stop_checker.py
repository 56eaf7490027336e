"""Stop strings matched across token boundaries, with held-back text flushed at the end.

Text arrives in pieces (one per token). A piece may end with the start of a stop string
("...TR" when the stop is "TRE"), so the checker holds back the longest suffix that is a
proper prefix of some stop string and releases it once it can no longer start a match:

    emitted text | held (could start a stop string) | new piece
                   ^ every future match starts at or after here

Semantics, the same for any split of the text into pieces: generation stops at the stop
string whose occurrence ENDS first (ties: the longer one, i.e. the one starting first); the
output ends before it, or after it with `include_stop_str_in_output` (then nothing is held
back). An occurrence counts only when it ends in a piece fed with `can_stop` (min_tokens).
`flush()` releases the held text when generation ends for any other reason.

Cost: a request's stop strings are compiled once into a `StopTable` (an Aho-Corasick
automaton, at most 1 + total stop characters nodes) that every choice shares read-only; a
`StopChecker` adds only its automaton state and held text (< the longest stop string).
Feeding a piece costs O(len(piece)) amortized automaton steps, whatever the number of stop
strings (at most the longest stop string's length of fallback steps for one character).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopTable:
    """The stop strings of one request, compiled once; immutable, shared by its choices.

    Node 0 is the root; every other node is a prefix of some stop string (its `depth` is
    its length). `goto[n]` maps a character to the child node, `fail[n]` is the node of
    n's longest proper suffix that is also a node, `match[n]` the longest stop string that
    is a suffix of node n (or None), and `rest[n]` the node of n's longest suffix that is
    a PROPER prefix of some stop string (n itself unless n is a leaf).

    Raises:
        ValueError: a stop string is empty.
    """

    __slots__ = ("stop", "include_stop_str_in_output", "_goto", "_fail",
                 "_depth", "_match", "_rest")

    def __init__(self, stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self.stop: tuple[str, ...] = tuple(dict.fromkeys(stop))
        self.include_stop_str_in_output = include_stop_str_in_output
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        terminal: list[str | None] = [None]
        for s in self.stop:
            node = 0
            for ch in s:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = goto[node][ch] = len(goto)
                    goto.append({})
                    depth.append(depth[node] + 1)
                    terminal.append(None)
                node = nxt
            terminal[node] = s
        fail = [0] * len(goto)
        match = terminal[:]
        rest = list(range(len(goto)))
        queue = list(goto[0].values())
        for node in queue:  # breadth first: a node's fail link is shallower than the node
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0)
                if match[child] is None:
                    match[child] = match[fail[child]]
                queue.append(child)
            if not goto[node]:
                rest[node] = rest[fail[node]]
        self._goto = tuple(goto)
        self._fail = tuple(fail)
        self._depth = tuple(depth)
        self._match = tuple(match)
        self._rest = tuple(rest)

    @property
    def num_nodes(self) -> int:
        return len(self._goto)


class StopChecker:
    """One choice's progress through a request's stop strings.

    Args:
        stop: the request's compiled `StopTable` (shared), or the stop strings themselves
            (then compiled here with `include_stop_str_in_output`).
    """

    __slots__ = ("table", "_state", "_held", "stop_str")

    def __init__(self, stop: StopTable | Sequence[str] = (),
                 include_stop_str_in_output: bool = False):
        self.table = stop if isinstance(stop, StopTable) else \
            StopTable(stop, include_stop_str_in_output)
        self._state = 0
        """The automaton node of the held text (include mode: of the emitted text's tail)."""
        self._held = ""
        self.stop_str: str | None = None
        """The stop string that ended generation, once one has."""

    @property
    def is_stopped(self) -> bool:
        return self.stop_str is not None

    def feed(self, text: str, can_stop: bool = True) -> str:
        """Add a piece; returns the text now safe to emit.

        Args:
            text: the new piece.
            can_stop: False until `min_tokens` were generated: matches are not acted on.
        """
        table = self.table
        if self.stop_str is not None:
            return ""
        if not table.stop:
            return text
        goto, fail, match, rest = table._goto, table._fail, table._match, table._rest
        q = self._state
        for i, ch in enumerate(text):
            while q and ch not in goto[q]:
                q = fail[q]
            q = goto[q].get(ch, 0)
            if can_stop and match[q] is not None:
                self.stop_str = stop = match[q]
                held, self._held, self._state = self._held, "", 0
                if table.include_stop_str_in_output:
                    return text[:i + 1]
                return (held + text)[:len(held) + i + 1 - len(stop)]
            q = rest[q]
        self._state = q
        if table.include_stop_str_in_output:
            return text
        pending = self._held + text
        cut = len(pending) - table._depth[q]
        self._held = pending[cut:]
        return pending[:cut]

    def flush(self) -> str:
        """Generation ended without a stop string: release the held text."""
        out, self._held = self._held, ""
        return "" if self.is_stopped else out
