"""Every field of vLLM's completion and chat request schemas (vLLM's
vllm/entrypoints/openai/{completion,chat_completion}/protocol.py), each with a non-default
value, through the gateway: applied (checked here on what reaches the engine or the response,
or by the named test) or refused with a 400 naming it; never accepted and ignored (issue 36).
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from pdserve.services.gateway.config import read_chat_template
from pdserve.services.gateway.protocol import (
    CHAT_NOT_IMPLEMENTED,
    NO_EFFECT_IN_VLLM,
    NOT_IMPLEMENTED,
)
from tests.services.gateway.conftest import SERVED_MODEL
from tests.services.gateway.helpers import CHAT, COMPLETIONS, chat_body, completion_body, stream

pytestmark = pytest.mark.asyncio(loop_scope="module")

ROOT = Path(__file__).resolve().parents[3]
COMMON = {
    "model": SERVED_MODEL, "frequency_penalty": 0.5, "logit_bias": {"10": 1.0}, "n": 2,
    "presence_penalty": 0.5, "seed": 7, "stop": ["zzz"], "stream": True,
    "stream_options": {"include_usage": True}, "temperature": 0.5, "top_p": 0.5,
    "user": "someone", "use_beam_search": True, "top_k": 5, "min_p": 0.1,
    "repetition_penalty": 1.5, "watermarking": True, "length_penalty": 2.0,
    "stop_token_ids": [5], "include_stop_str_in_output": True, "ignore_eos": True,
    "min_tokens": 1, "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 2, "truncation_side": "right", "allowed_token_ids": [10, 11],
    "prompt_logprobs": 1, "logprob_token_ids": [1], "bad_words": ["Hello"],
    "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"},
    "priority": 1, "request_id": "my-id", "session_id": "s1",
    "return_tokens_as_token_ids": True, "return_token_ids": True,
    "routed_experts_prompt_start": 1, "return_token_offsets": True, "return_mm_kwargs": False,
    "mm_payload": "none",
    "cache_salt": "salt", "kv_transfer_params": {"do_remote_decode": True},
    "ec_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1},
    "repetition_detection": {"max_pattern_size": 2}, "thinking_token_budget": 10,
    "stream_interval": 2,
}
COMPLETION_FIELDS = {**COMMON, "prompt": "Hello there, world", "echo": True, "logprobs": 2,
                     "max_tokens": 3, "suffix": "!", "prompt_embeds": "AAAA",
                     "add_special_tokens": False}
"""vLLM's CompletionRequest, every field, with a value other than its default."""
CHAT_FIELDS = {**COMMON, "messages": [{"role": "user", "content": "Hello there"}],
               "logprobs": True, "top_logprobs": 2, "max_tokens": 3,
               "max_completion_tokens": 3, "tools": [{"type": "function", "function": {
                   "name": "f", "parameters": {"type": "object"}}}],
               "tool_choice": "required", "reasoning_effort": "low",
               "include_reasoning": False, "parallel_tool_calls": False, "echo": True,
               "add_generation_prompt": False, "continue_final_message": True,
               "add_special_tokens": True, "documents": [{"title": "t", "text": "x"}],
               "chat_template": "{{ messages }}", "chat_template_kwargs": {"x": 1},
               "media_io_kwargs": {"image": {}}, "mm_processor_kwargs": {"a": 1},
               "return_prompt_text": True}
"""vLLM's ChatCompletionRequest, every field, with a value other than its default."""
COMPANIONS = {"stream_options": {"stream": True},
              "length_penalty": {"use_beam_search": True, "n": 2},
              "return_tokens_as_token_ids": {"logprobs": True, "top_logprobs": 2},
              "truncation_side": {"truncate_prompt_tokens": 2},
              "top_logprobs": {"logprobs": True}, "tool_choice": {"tools": CHAT_FIELDS["tools"]},
              "parallel_tool_calls": {"tools": CHAT_FIELDS["tools"]},
              "continue_final_message": {"add_generation_prompt": False, "messages": [
                  {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]},
              "echo": {"add_generation_prompt": False, "continue_final_message": True,
                       "messages": [{"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hel"}]}}
"""Fields that only act together with another."""
COMPLETION_COMPANIONS = {"return_tokens_as_token_ids": {"logprobs": 2}, "echo": {}}


def _sp(gw):
    return gw.prefill.rec.requests[-1].sampling_params


def _token_ids_returned(gw, body: dict) -> bool:
    choice = body["choices"][0]
    prompt_ids = body.get("prompt_token_ids", choice.get("prompt_token_ids"))
    return (prompt_ids == list(gw.prefill.rec.requests[-1].prompt_token_ids)
            and len(choice["token_ids"]) == body["usage"]["completion_tokens"] > 0)


def _text(body: dict) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _tokens_as_ids(body: dict) -> bool:
    """Every logprob token (and alternative) reads "token_id:<id>"."""
    lps = body["choices"][0]["logprobs"]
    if "content" in lps:  # chat
        tokens = [e["token"] for c in lps["content"] for e in [c, *c["top_logprobs"]]]
    else:
        tokens = lps["tokens"] + [t for top in lps["top_logprobs"] for t in top]
    return bool(tokens) and all(t.startswith("token_id:") and t[9:].isdigit() for t in tokens)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6)


CHECKED_HERE = {
    "frequency_penalty": lambda gw, r: _close(_sp(gw).frequency_penalty, 0.5),
    "presence_penalty": lambda gw, r: _close(_sp(gw).presence_penalty, 0.5),
    "logit_bias": lambda gw, r: dict(_sp(gw).logit_bias) == {10: 1.0},
    "seed": lambda gw, r: _sp(gw).seed == 7,
    "temperature": lambda gw, r: _close(_sp(gw).temperature, 0.5),
    "top_p": lambda gw, r: _close(_sp(gw).top_p, 0.5),
    "top_k": lambda gw, r: _sp(gw).top_k == 5,
    "min_p": lambda gw, r: _close(_sp(gw).min_p, 0.1),
    "repetition_penalty": lambda gw, r: _close(_sp(gw).repetition_penalty, 1.5),
    "stop_token_ids": lambda gw, r: list(_sp(gw).stop_token_ids) == [5],
    "ignore_eos": lambda gw, r: _sp(gw).ignore_eos,
    "min_tokens": lambda gw, r: _sp(gw).min_tokens == 1,
    "allowed_token_ids": lambda gw, r: list(_sp(gw).allowed_token_ids) == [10, 11],
    "bad_words": lambda gw, r: len(_sp(gw).bad_words_token_ids) >= 1,
    "prompt_logprobs": lambda gw, r: _sp(gw).prompt_logprobs == 1,
    "priority": lambda gw, r: _sp(gw).priority == 1,
    "structured_outputs": lambda gw, r: _sp(gw).structured_outputs.regex == "a+",
    "response_format": lambda gw, r: _sp(gw).structured_outputs.json_object,
    "max_tokens": lambda gw, r: _sp(gw).max_tokens == 3,
    "max_completion_tokens": lambda gw, r: _sp(gw).max_tokens == 3,
    "cache_salt": lambda gw, r: gw.prefill.rec.requests[-1].cache_salt != "",
    "truncate_prompt_tokens": lambda gw, r: len(gw.prefill.rec.requests[-1].prompt_token_ids)
    == 2,
    "truncation_side": lambda gw, r: len(gw.prefill.rec.requests[-1].prompt_token_ids) == 2,
    "n": lambda gw, r: len(r.json()["choices"]) == 2,
    "stream": lambda gw, r: r.headers["content-type"].startswith("text/event-stream"),
    "stream_options": lambda gw, r: '"usage": {"prompt_tokens"' in r.text.replace(
        '"usage":{', '"usage": {'),
    "request_id": lambda gw, r: r.json()["id"].endswith("-my-id"),
    "model": lambda gw, r: r.json()["model"] == SERVED_MODEL,
    "logprobs": lambda gw, r: r.json()["choices"][0]["logprobs"] is not None,
    "top_logprobs": lambda gw, r: _sp(gw).logprobs == 2,
    "echo": lambda gw, r: _text(r.json()).startswith(
        "Hel" if "message" in r.json()["choices"][0] else "Hello there, world"),
    "return_token_ids": lambda gw, r: _token_ids_returned(gw, r.json()),
    "return_tokens_as_token_ids": lambda gw, r: _tokens_as_ids(r.json()),
}
"""Applied, checked on the engine's SamplingParams / prompt or on the response."""
PROVED_BY = {
    "prompt": "tests/services/gateway/test_generation.py::test_prompt_forms",
    "messages": "tests/services/gateway/test_chat_encoding.py::"
                "test_ordinary_messages_match_apply_chat_template",
    "stop": "tests/services/gateway/test_generation.py::"
            "test_stop_string_and_markers_never_in_output",
    "include_stop_str_in_output": "tests/services/gateway/test_generation.py::"
                                  "test_include_stop_str_and_stop_token_ids",
    "skip_special_tokens": "tests/e2e/test_vllm_sampling.py::"
                           "test_allowed_token_ids_only_those_are_generated",
    "add_special_tokens": "tests/services/gateway/test_generation.py::test_prompt_forms",
    "tools": "tests/services/gateway/test_tools.py::test_forced_modes_carry_a_structural_tag",
    "tool_choice": "tests/services/gateway/test_tools.py::"
                   "test_forced_modes_carry_a_structural_tag",
    "parallel_tool_calls": "tests/services/gateway/test_tools.py::"
                           "test_forced_modes_carry_a_structural_tag",
    "add_generation_prompt": "tests/services/gateway/test_tools.py::"
                             "test_the_shipped_template_renders_tools_and_nothing_else_differently",
    "continue_final_message": "tests/services/gateway/test_chat_encoding.py::"
                              "test_continue_final_message_matches",
    "chat_template_kwargs": "tests/services/gateway/test_vllm_fields.py::"
                            "test_chat_template_kwargs_reach_the_template",
    "use_beam_search": "tests/e2e/test_vllm_sampling.py::"
                       "test_beam_search_best_beam_equals_transformers",
    "length_penalty": "tests/services/gateway/test_sampling_fields.py::"
                      "test_beam_score_is_vllms",
}
"""Applied, proved by these tests (the engine-side effect of each sampling field above is
proved in tests/shared/engine/test_sampler*.py and tests/e2e/test_vllm_sampling.py)."""


def _exists(node: str) -> bool:
    path, _, name = node.partition("::")
    if not (ROOT / path).is_file():
        return False
    tree = ast.parse((ROOT / path).read_text())
    return not name or any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                           and n.name == name for n in tree.body)


@pytest.mark.parametrize("path,fields,refused", [
    (COMPLETIONS, COMPLETION_FIELDS, {**NOT_IMPLEMENTED, "suffix": None}),
    (CHAT, CHAT_FIELDS, {**NOT_IMPLEMENTED, **CHAT_NOT_IMPLEMENTED})])
async def test_every_vllm_field_is_applied_or_refused(make_gateway, path, fields, refused):
    # Chat: a gateway that renders and parses tools (SmolLM2's template does not render them).
    gateway = await make_gateway() if path == COMPLETIONS else await make_gateway(
        chat_template=read_chat_template("tool_chat_template_smollm2_hermes.jinja"),
        enable_auto_tool_choice=True, tool_call_parser="hermes")
    base = ({"model": SERVED_MODEL, "prompt": "Hello there, world", "max_tokens": 3}
            if path == COMPLETIONS else
            {"model": SERVED_MODEL, "messages": CHAT_FIELDS["messages"], "max_tokens": 3})
    unclassified = [f for f in fields if f not in refused and f not in NO_EFFECT_IN_VLLM
                    and f not in CHECKED_HERE and f not in PROVED_BY]
    assert not unclassified
    for field, value in fields.items():
        companions = COMPANIONS.get(field, {})
        if path == COMPLETIONS:
            companions = COMPLETION_COMPANIONS.get(field, companions)
        body = {**base, **companions, field: value}
        r = await gateway.http.post(path, json=body)
        if field in refused:
            assert r.status_code == 400, (field, r.text)
            assert r.json()["error"]["param"] == field, (field, r.text)
            continue
        assert r.status_code == 200, (field, r.text)
        if field in CHECKED_HERE:
            assert CHECKED_HERE[field](gateway, r), (field, r.text[:300])
        elif field in PROVED_BY:
            assert _exists(PROVED_BY[field]), PROVED_BY[field]


async def test_no_effect_values_of_unimplemented_fields_pass(gateway):
    """A client that sends vLLM's defaults (as some SDKs do) is not refused."""
    body = {"model": SERVED_MODEL, "prompt": "Hi", "max_tokens": 2, "use_beam_search": False,
            "length_penalty": 1.0, "spaces_between_special_tokens": True,
            "return_token_ids": False, "kv_transfer_params": None, "guided_decoding_backend":
            "xgrammar"}
    r = await gateway.http.post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    r = await gateway.http.post(COMPLETIONS, json={**body, "guided_decoding_backend": "outlines"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_decoding_backend"
    r = await gateway.http.post(COMPLETIONS, json={**body, "length_penalty": 1})
    assert r.status_code == 200, r.text
    r = await gateway.http.post(COMPLETIONS, json={**body, "use_beam_search": 1})
    assert r.status_code == 400, r.text


@pytest.mark.parametrize("path,body", [
    (COMPLETIONS, completion_body("Hello there", max_tokens=6, n=2, seed=3, return_token_ids=True)),
    (CHAT, chat_body("Hello there", max_tokens=6, n=2, seed=3, return_token_ids=True))])
async def test_return_token_ids_streamed_and_not(gateway, fast_tokenizer, path, body):
    """vLLM's shape: each choice's token_ids (deltas when streamed) and the prompt's ids
    (per choice on completions, per response on chat; the first chunk when streamed)."""
    whole = (await gateway.http.post(path, json=body)).json()
    prompt_ids = list(gateway.prefill.rec.requests[-1].prompt_token_ids)
    chunks = await stream(gateway.http, path, body)
    for i in range(2):
        choice = whole["choices"][i]
        text = choice["text"] if path == COMPLETIONS else choice["message"]["content"]
        assert fast_tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == text
        streamed = [t for c in chunks for ch in c["choices"] if ch["index"] == i
                    for t in ch.get("token_ids", [])]
        assert streamed == choice["token_ids"]
        if path == COMPLETIONS:
            assert choice["prompt_token_ids"] == prompt_ids
            first = next(ch for c in chunks for ch in c["choices"] if ch["index"] == i)
            assert first["prompt_token_ids"] == prompt_ids
    if path == CHAT:
        assert whole["prompt_token_ids"] == prompt_ids
        assert chunks[0]["prompt_token_ids"] == prompt_ids
        assert all("prompt_token_ids" not in c for c in chunks[1:])


async def test_chat_echo_streamed_and_not(gateway):
    """vLLM's chat echo: the final assistant message's content starts the answer, streamed as
    its own first content chunk; a last message of another role is not echoed."""
    body = {"model": SERVED_MODEL, "max_tokens": 4, "seed": 1, "echo": True,
            "add_generation_prompt": False, "continue_final_message": True,
            "messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Well,"}]}
    whole = (await gateway.http.post(CHAT, json=body)).json()
    plain = (await gateway.http.post(CHAT, json={**body, "echo": False})).json()
    content = whole["choices"][0]["message"]["content"]
    assert content == "Well," + plain["choices"][0]["message"]["content"]
    chunks = await stream(gateway.http, CHAT, body)
    assert chunks[1]["choices"][0]["delta"] == {"content": "Well,"}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"]) == content
    user_last = (await gateway.http.post(CHAT, json=chat_body(
        "Hello", max_tokens=4, seed=1, echo=True))).json()
    assert not user_last["choices"][0]["message"]["content"].startswith("Hello")


async def test_chat_template_kwargs_reach_the_template(make_gateway, fast_tokenizer):
    gateway = await make_gateway(chat_template=(
        "{% for m in messages %}{{ m.content }}{% endfor %}{{ suffix_word | default('') }}"))
    for kwargs, tail in (({"suffix_word": " zebra"}, " zebra"), (None, "")):
        r = await gateway.http.post(CHAT, json=chat_body(
            "Hello", max_tokens=2, chat_template_kwargs=kwargs))
        assert r.status_code == 200, r.text
        prompt = list(gateway.prefill.rec.requests[-1].prompt_token_ids)
        assert fast_tokenizer.decode(prompt) == "Hello" + tail


def test_the_walk_covers_every_field_of_vllm_0_32():
    """tests/data/vllm_request_fields.json lists the request fields of vLLM 0.32's own
    CompletionRequest and ChatCompletionRequest (read from the installed package): each one
    is walked above, so none can be accepted and ignored unnoticed."""
    import json

    names = json.loads((ROOT / "tests" / "data" / "vllm_request_fields.json").read_text())
    assert not set(names["completion"]) - set(COMPLETION_FIELDS)
    assert not set(names["chat"]) - set(CHAT_FIELDS)
