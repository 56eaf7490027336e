"""StopChecker: matches across piece boundaries, flush, split-invariance and per-piece equality
with a naive reference (hypothesis), and the size of the defaults' worst-case stop table."""

from __future__ import annotations

import random
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.stop_checker import StopChecker, StopTable


def _run(stop, pieces, include=False):
    checker = StopChecker(stop, include)
    out = []
    for p in pieces:
        out.append(checker.feed(p))
        if checker.is_stopped:
            break
    else:
        out.append(checker.flush())
    return out, checker.stop_str


def _reference(stop, text, include=False):
    """Stop at the occurrence that ends first (ties: the one starting first)."""
    best = None
    for s in stop:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    if best is None:
        return text, None
    end, start, s = best
    return (text[:end] if include else text[:start]), s


def test_match_across_pieces_and_no_stop_text_emitted():
    out, stop = _run(["TRE"], ["UNO DUE T", "R", "E and more"])
    assert "".join(out) == "UNO DUE " and stop == "TRE"
    assert out[0] == "UNO DUE "  # "T" held back: it may start "TRE"


def test_held_back_text_is_flushed_when_no_stop_completes():
    out, stop = _run(["TRE\nAAAA"], ["UNO DUE ", "TR", "E"])
    assert stop is None
    assert "".join(out) == "UNO DUE TRE"
    assert out[-1] == "TRE"  # everything held back came out in the flush


def test_include_stop_str_in_output():
    out, stop = _run(["ab"], ["xa", "by"], include=True)
    assert "".join(out) == "xab" and stop == "ab"


def test_first_ending_stop_wins():
    assert _run(["bcd", "c"], ["abcd"]) == (["ab"], "c")


def test_min_tokens_phase_does_not_stop():
    checker = StopChecker(["7"])
    assert checker.feed("1 7 ", can_stop=False) == "1 7 "
    assert not checker.is_stopped
    assert checker.feed("8 7 9") == "8 "
    assert checker.is_stopped


_alphabet = st.sampled_from("ab\n7é🙂")


@settings(max_examples=400, deadline=None)
@given(text=st.text(_alphabet, max_size=40),
       stop=st.lists(st.text(_alphabet, min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=12),
       include=st.booleans())
def test_streamed_pieces_equal_whole_text_result(text, stop, cuts, include):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    streamed, streamed_stop = _run(stop, pieces, include)
    whole, whole_stop = _run(stop, [text], include)
    expected, expected_stop = _reference(stop, text, include)
    assert "".join(streamed) == "".join(whole) == expected
    assert streamed_stop == whole_stop == expected_stop


# ---- the shared table: size and equivalence with a naive reference


def test_worst_case_table_within_the_default_limits_is_small():
    """n=128 choices x 32 stop strings x 512 characters (the defaults' worst case): one
    table for the request, linear in the stop characters (the prefix sets took ~700 MiB)."""
    config = GatewayConfig(model_path="unused")
    rng = random.Random(0)
    stop = ["".join(rng.choice("abcdefgh") for _ in range(config.max_stop_string_length))
            for _ in range(config.max_stop_strings)]
    tracemalloc.start()
    try:
        table = StopTable(stop)
        checkers = [StopChecker(table) for _ in range(config.max_n)]
        for c in checkers:
            c.feed(stop[0][:300])  # each choice holds back 300 characters
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert table.num_nodes <= 1 + sum(map(len, stop))
    assert all(c.table is table for c in checkers)
    assert peak < 16 * 2**20, f"{peak / 2**20:.1f} MiB"
    assert [c.feed(stop[0][300:] + "tail") for c in checkers[:2]] == ["", ""]
    assert checkers[0].stop_str == stop[0]


def _naive_held(text: str, stop) -> int:
    """The longest suffix of `text` that is a proper prefix of a stop string (length)."""
    for k in range(len(text), 0, -1):
        if any(len(s) > k and s.startswith(text[-k:]) for s in stop):
            return k
    return 0


def _naive_stream(stop, pieces, can_stop, include):
    """Per-piece outputs, from scratch on the whole text so far: the first occurrence by
    end (ties: the longest) among those ending inside a piece fed with can_stop."""
    outs, text, emitted, flags = [], "", 0, []
    for piece, ok in zip(pieces, can_stop):
        text += piece
        flags += [ok] * len(piece)
        hits = [(e, -len(s), s) for s in stop for e in range(len(s), len(text) + 1)
                if text[e - len(s):e] == s and flags[e - 1]]
        if hits:
            end, _, s = min(hits)
            cut = end if include else end - len(s)
            outs.append(text[emitted:max(cut, emitted)])
            return outs, s
        keep = len(text) if include else len(text) - _naive_held(text, stop)
        outs.append(text[emitted:keep])
        emitted = keep
    outs.append(text[emitted:])
    return outs, None


@settings(max_examples=600, deadline=None)
@given(text=st.text(_alphabet, max_size=40),
       stop=st.lists(st.text(_alphabet, min_size=1, max_size=6), max_size=5),
       cuts=st.lists(st.integers(0, 40), max_size=12),
       min_pieces=st.integers(0, 6),
       include=st.booleans())
def test_checker_equals_naive_reference_per_piece(text, stop, cuts, min_pieces, include):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    can_stop = [i >= min_pieces for i in range(len(pieces))]
    table = StopTable(stop, include)
    for checker in (StopChecker(table), StopChecker(table)):  # the table is shared, read-only
        outs = []
        for piece, ok in zip(pieces, can_stop):
            outs.append(checker.feed(piece, ok))
            if checker.is_stopped:
                break
        else:
            outs.append(checker.flush())
        assert (outs, checker.stop_str) == _naive_stream(stop, pieces, can_stop, include)
