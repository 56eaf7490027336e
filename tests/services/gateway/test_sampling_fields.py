"""The gateway's side of vLLM's bad_words and truncate_prompt_tokens (services/gateway/
sampling.py): vLLM's tokenization rule and truncation ends, on the real tokenizer."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.services.gateway.beam_search import Beam, beam_score
from pdserve.services.gateway.errors import GatewayError
from pdserve.services.gateway.sampling import (
    MAX_BAD_WORDS_TOTAL_TOKENS,
    MAX_NUM_BAD_WORDS,
    tokenize_bad_words,
    truncate_prompt,
)


def tokenize(fast_tokenizer, words):
    async def encode(text: str, add_special_tokens: bool) -> list[int]:
        return fast_tokenizer.encode(text, add_special_tokens=add_special_tokens)

    return asyncio.run(tokenize_bad_words(words, encode))


def test_bad_words_are_tokenized_with_and_without_a_leading_space(fast_tokenizer):
    enc = lambda text: fast_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert len(enc("Paris")) == len(enc(" Paris")) == 1 and enc("Paris") != enc(" Paris")
    assert tokenize(fast_tokenizer, ["Paris"]) == [enc("Paris"), enc(" Paris")]
    assert tokenize(fast_tokenizer, ["  Paris"]) == [enc("Paris"), enc(" Paris")]  # lstrip
    # vLLM keeps the spaced form only when it has as many tokens as the plain one.
    for word in ("Constantinople", "hello world"):
        plain, spaced = enc(word), enc(" " + word)
        expected = [plain] + ([spaced] if len(spaced) == len(plain) and spaced[0] != plain[0]
                              else [])
        assert tokenize(fast_tokenizer, [word]) == expected
    assert tokenize(fast_tokenizer, None) is None and tokenize(fast_tokenizer, []) is None


def test_bad_words_limits(fast_tokenizer):
    with pytest.raises(GatewayError) as e:
        tokenize(fast_tokenizer, [" "])
    assert e.value.param == "bad_words"
    with pytest.raises(GatewayError) as e:
        tokenize(fast_tokenizer, [f"word{i}" for i in range(MAX_NUM_BAD_WORDS)])
    assert e.value.param == "bad_words" and str(MAX_NUM_BAD_WORDS) in str(e.value)
    with pytest.raises(GatewayError) as e:
        tokenize(fast_tokenizer, ["one two three " * 200])
    assert e.value.param == "bad_words" and str(MAX_BAD_WORDS_TOTAL_TOKENS) in str(e.value)


def test_truncate_prompt_keeps_the_last_or_first_n():
    ids = list(range(10))
    assert truncate_prompt(ids, None, 8) == ids
    assert truncate_prompt(ids, 3, 8) == [7, 8, 9]
    assert truncate_prompt(ids, 3, 8, "left") == [7, 8, 9]
    assert truncate_prompt(ids, 3, 8, "right") == [0, 1, 2]
    assert truncate_prompt(ids, -1, 8) == ids[2:]  # -1: max_model_len
    assert truncate_prompt(ids[:4], 6, 8) == ids[:4]
    for bad in (-2, 0, 9):
        with pytest.raises(GatewayError) as e:
            truncate_prompt(ids, bad, 8)
        assert e.value.param == "truncate_prompt_tokens"


def test_beam_score_is_vllms():
    """vLLM's get_beam_search_score: cum logprob / len ** length_penalty, the length counting
    the prompt and not a final EOS; a longer beam wins under a larger length_penalty."""
    eos = 2
    short = Beam([7, 8, 9, eos], -2.0)  # 3 tokens counted
    long = Beam([7, 8, 9, 10, 11, 12], -3.0)
    assert beam_score(short, eos, 1.0) == pytest.approx(-2.0 / 3)
    assert beam_score(long, eos, 1.0) == pytest.approx(-0.5)
    assert beam_score(short, eos, 0.0) > beam_score(long, eos, 0.0)  # raw cum logprob
    assert beam_score(short, eos, 2.0) < beam_score(long, eos, 2.0)
