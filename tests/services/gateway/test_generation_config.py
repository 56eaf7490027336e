"""The model's generation_config.json as request defaults (vLLM's `--generation-config
auto`): unset sampling fields take its values, its extra EOS ids stop generation (as
stop_token_ids, unless ignore_eos); `--generation-config vllm` turns it off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.services.gateway.generation_config import (
    GenerationDefaults,
    load_generation_defaults,
)
from pdserve.services.gateway.protocol import CompletionRequest
from pdserve.services.gateway.sampling import build_sampling_params
from tests.services.gateway.conftest import SERVED_MODEL, running_gateway

QWEN_LIKE = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
             "eos_token_id": [2, 0, 7], "bos_token_id": 1}
"""Qwen2.5-Instruct's recommended sampling; three EOS ids, the tokenizer's (2) among them."""


@pytest.fixture
def model_dir(model_path, tmp_path) -> Path:
    """The test model's tokenizer and config, with a generation config of QWEN_LIKE."""
    for f in Path(model_path).iterdir():
        if f.name != "generation_config.json":
            (tmp_path / f.name).symlink_to(f)
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN_LIKE))
    return tmp_path


def test_load_reads_sampling_defaults_and_the_extra_eos_ids(model_dir, tmp_path_factory):
    defaults = load_generation_defaults("auto", str(model_dir), tokenizer_eos_token_id=2)
    assert defaults == GenerationDefaults(temperature=0.7, top_p=0.8, top_k=20,
                                          repetition_penalty=1.05, extra_eos_token_ids=(0, 7))
    assert load_generation_defaults("vllm", str(model_dir), 2) == GenerationDefaults()
    assert load_generation_defaults(str(model_dir), "/nowhere", 2) == defaults  # a directory
    empty = tmp_path_factory.mktemp("none")
    assert load_generation_defaults("auto", str(empty), 2) == GenerationDefaults()
    with pytest.raises(FileNotFoundError, match="--generation-config"):
        load_generation_defaults(str(empty), str(model_dir), 2)
    (empty / "generation_config.json").write_text('{"temperature": "hot"}')
    with pytest.raises(ValueError, match="temperature must be a number"):
        load_generation_defaults("auto", str(empty), 2)


def test_the_request_wins_and_ignore_eos_drops_the_extra_eos_ids():
    defaults = GenerationDefaults(temperature=0.7, top_k=20, extra_eos_token_ids=(0, 7))

    def params(**body):
        req = CompletionRequest(prompt="x", **body)
        return build_sampling_params(req, max_tokens=4, logprobs=None, vocab_size=100,
                                     max_n=4, defaults=defaults)

    unset = params()
    assert (unset.temperature, unset.top_k, unset.top_p) == (0.7, 20, 1.0)
    assert unset.stop_token_ids == [0, 7]
    own = params(temperature=0.0, top_k=3, stop_token_ids=[7, 9])
    assert (own.temperature, own.top_k) == (0.0, 3) and own.stop_token_ids == [7, 9, 0]
    assert params(ignore_eos=True).stop_token_ids == []


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("source, want", [
    ("auto", (0.7, 0.8, 20, 1.05, [0, 7])),
    ("vllm", (1.0, 1.0, 0, 1.0, [])),
])
async def test_the_engines_get_the_defaults_through_the_gateway(cluster, model_dir, source,
                                                                want):
    async with running_gateway(str(model_dir), cluster, generation_config=source) as gw:
        r = await gw.http.post("/v1/completions", json={
            "model": SERVED_MODEL, "prompt": "Once upon a time", "max_tokens": 4})
    assert r.status_code == 200, r.text
    sent = cluster.prefills[0].rec.requests[-1].sampling_params
    got = (round(sent.temperature, 4), round(sent.top_p, 4), sent.top_k,
           round(sent.repetition_penalty, 4), list(sent.stop_token_ids))
    assert got == want


def test_max_new_tokens_caps_every_request(tmp_path):
    """vLLM maps the config's max_new_tokens to a max_tokens cap: an unset max_tokens takes
    it (chat: instead of the whole remaining context), a larger one is lowered to it."""
    from pdserve.services.gateway.sampling import resolve_max_tokens

    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": 32}')
    defaults = load_generation_defaults("auto", str(tmp_path), 2)
    assert defaults.max_new_tokens == 32
    cap = defaults.max_new_tokens
    assert resolve_max_tokens(10, None, 2048, default=None, cap=cap) == 32
    assert resolve_max_tokens(10, 100, 2048, default=None, cap=cap) == 32
    assert resolve_max_tokens(10, 5, 2048, default=None, cap=cap) == 5
    assert resolve_max_tokens(10, None, 2048, default=16, cap=cap) == 16
    assert resolve_max_tokens(2040, None, 2048, default=None, cap=cap) == 8
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": 0}')
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        load_generation_defaults("auto", str(tmp_path), 2)
