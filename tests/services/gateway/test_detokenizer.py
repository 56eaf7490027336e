"""IncrementalDetokenizer with the real tokenizer: multi-byte characters split across tokens."""

from __future__ import annotations

import pytest

from pdserve.services.gateway.detokenizer import IncrementalDetokenizer
from pdserve.services.gateway.tokenization import GatewayTokenizer

TEXTS = [
    "Hello 🙂 world 🎉🎉 done",
    "你好，世界！中文文本测试。",
    "mixed: Café — naïve 👩‍👩‍👧 日本語 עברית العربية",
    "plain ascii text, nothing special.",
]


@pytest.fixture(scope="module")
def gw_tokenizer(fast_tokenizer):
    tok = GatewayTokenizer(fast_tokenizer)
    yield tok
    tok.close()


def _pieces(tok: GatewayTokenizer, token_ids, prompt=()) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.step(t) for t in token_ids]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_full_decode_and_never_split_a_character(gw_tokenizer, text):
    ids = gw_tokenizer.tokenizer.encode(text, add_special_tokens=False)
    # The byte-level tokenizer really splits these characters across tokens.
    if any(ord(c) > 127 for c in text):
        assert any("\ufffd" in gw_tokenizer.token_text(t) for t in ids)
    prompt = gw_tokenizer.tokenizer.encode("Say:", add_special_tokens=False)
    pieces = _pieces(gw_tokenizer, ids, prompt)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_special_tokens_are_skipped(gw_tokenizer):
    ids = gw_tokenizer.tokenizer.encode("A<|im_end|>B<|im_start|>", add_special_tokens=False)
    assert gw_tokenizer.tokenizer.eos_token_id in ids
    assert "".join(_pieces(gw_tokenizer, ids)) == "AB"


def test_truncated_character_is_flushed_not_lost(gw_tokenizer):
    ids = gw_tokenizer.tokenizer.encode("ok 你", add_special_tokens=False)
    cut = ids[:-1]  # the last token completes "你": without it the bytes are incomplete
    detok = IncrementalDetokenizer(gw_tokenizer)
    streamed = "".join(detok.step(t) for t in cut)
    assert "\ufffd" not in streamed
    tail = detok.flush()
    assert streamed + tail == gw_tokenizer.decode(cut)
    assert tail.endswith("\ufffd")


def test_one_token_at_a_time_matches_full_decode_for_a_long_mixed_text(gw_tokenizer):
    text = " ".join(TEXTS) * 3
    ids = gw_tokenizer.tokenizer.encode(text, add_special_tokens=False)
    assert "".join(_pieces(gw_tokenizer, ids)) == gw_tokenizer.decode(ids)
