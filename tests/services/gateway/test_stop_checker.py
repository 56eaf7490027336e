"""StopChecker: matches across piece boundaries, flush, and split-invariance (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.stop_checker import StopChecker


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
