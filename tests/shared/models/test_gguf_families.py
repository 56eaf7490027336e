"""GGUF files of each supported family served token for token (issue 34).

Each family's tiny random checkpoint (test_architectures.py's) is written as llama.cpp writes a
GGUF (gguf_writer.py: its tensor names and metadata, the llama Q/K permutation, Llama 3's rope
scaling as a `rope_freqs` tensor, SmolLM2's tokenizer), served by pdserve from the .gguf path
(converted once through transformers' GGUF loader), and its greedy tokens compared with
transformers' fp32 model on the original checkpoint: F32 tensors, so they must be equal. A GGUF
architecture or rope scaling pdserve does not serve is refused in one line naming it, from the
header alone: by `check_model_dir`, and by `pdserve serve` / `pdserve up` with exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType

from pdserve.shared.llm import LLM
from pdserve.shared.models.architectures import check_model_dir
from pdserve.shared.models.convert import resolve_model_path
from pdserve.shared.models.gguf_check import _llama3_from_factors
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.tokenizer import get_tokenizer
from tests.shared.models.gguf_writer import (
    llama3_rope_factors,
    roundtrip,
    smollm2_tokenizer_metadata,
    write_gguf,
    write_header_only_gguf,
)
from tests.shared.models.test_architectures import FAMILIES, build_checkpoint
from tests.shared.models.test_gemma import build_gemma_checkpoint
from tests.shared.models.test_rope_scaling import FAMILIES as ROPE_FAMILIES

pytestmark = pytest.mark.fp32_only  # the reference is transformers' fp32 model

GEMMA = dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=32)
GGUF_FAMILIES = {
    **{name: FAMILIES[name] for name in ("llama", "llama3-rope", "llama-linear-rope",
                                         "llama-bias", "qwen2", "qwen3", "mistral", "phi3",
                                         "phi3-window")},
    "phi3-longrope": ROPE_FAMILIES["longrope"][:2],
    "gemma2": ("Gemma2Config", {**GEMMA, "attn_logit_softcapping": 8.0,
                                "final_logit_softcapping": 5.0}),
    "gemma3": ("Gemma3TextConfig", {**GEMMA, "num_hidden_layers": 6, "tie_word_embeddings": False,
                                    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}}),
}
"""Every family of FAMILIES: llama (tied embeddings; the others untied), Llama 3 and linear
rope scaling, q/k/v/o biases (llama.cpp permutes the q/k ones too) with head_dim 48, Mistral
(llama.cpp writes it as a llama GGUF), Qwen2, Qwen3 (head_dim 32, not hidden / heads: read from
attention.key_length), Phi-3 (fused qkv and gate_up; with a 40-token window, which the
41-token prompt crosses, as Phi-3-mini-4k's 2047) and Phi-3.5's longrope (test_rope_scaling.py's,
attention factor from 256 / 64); and Gemma 2 / 3 as test_gemma.py builds them (random (1 + w)
norms, soft-caps, a 32-token window the 41-token prompt crosses, Gemma 3's linear-scaled global
rope), within what a GGUF can say: llama.cpp fixes the query scale to 1 / sqrt(head_dim), Gemma
3's local rope base to 10000 and its layer pattern to five local layers, then one global."""
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory) -> Path:
    """The conversions' cache, away from the user's (the default model stays in its own)."""
    return tmp_path_factory.mktemp("gguf-cache")


def serve(path: Path, cache: Path, max_model_len: int = 256) -> LLM:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_CACHE_DIR", str(cache))
        return LLM(str(path), kv_cache_memory="64MiB", max_model_len=max_model_len)


@pytest.mark.parametrize("name", list(GGUF_FAMILIES))
def test_a_gguf_gives_transformers_tokens(name, tmp_path, gguf_cache):
    check_tokens(name, tmp_path, gguf_cache)


@pytest.mark.parametrize("name, quant", [("llama3-rope", GGMLQuantizationType.Q4_1),
                                         ("qwen3", GGMLQuantizationType.Q8_0)])
def test_a_quantized_gguf_gives_the_tokens_of_its_weights(name, quant, tmp_path, gguf_cache):
    """Q4_1 (the default model's type; Q/K permuted before quantizing) and Q8_0: transformers
    dequantizes them into fp32; the reference is the checkpoint with those same weights."""
    check_tokens(name, tmp_path, gguf_cache, quant)


def check_tokens(name: str, tmp_path: Path, gguf_cache: Path,
                 quant: GGMLQuantizationType | None = None) -> None:
    config_class, extra = GGUF_FAMILIES[name]
    build = build_gemma_checkpoint if name.startswith("gemma") else build_checkpoint
    model = build(tmp_path / "hf", config_class, **extra)
    path = write_gguf(model, tmp_path / f"tiny-{name}.gguf", quant=quant,
                      name="Mistral Tiny" if name == "mistral" else "tiny")
    if quant is not None:
        model = roundtrip(model, quant)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (6, 41)]
    with torch.inference_mode():
        want = [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    # longrope is served up to its original length (test_rope_scaling.py)
    llm = serve(path, gguf_cache, 64 if name == "phi3-longrope" else 256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want, name
    converted = Path(llm.model_config.model_path)
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["tie_word_embeddings"] == model.config.tie_word_embeddings
    assert converted.name == path.stem  # the served name is the file's
    # the tokenizer and chat template llama.cpp wrote, as SmolLM2's own
    template = smollm2_tokenizer_metadata()["tokenizer.chat_template"]
    assert (converted / "chat_template.jinja").read_text() == template
    text = "Hello world, 1234 tokens!\n\tÉtoile <|im_end|>"
    assert llm.tokenizer.encode(text) == get_tokenizer(str(resolve_model_path())).encode(text)


@pytest.mark.parametrize("rope, head_dim", [
    ({"factor": 32.0, "original_max_position_embeddings": 8192}, 64),  # Llama 3.2 1B / 3B
    ({"factor": 8.0, "original_max_position_embeddings": 8192}, 128),  # Llama 3.1 8B
])
def test_llama3_rope_comes_back_from_rope_freqs(rope, head_dim):
    """llama.cpp keeps only the per-frequency divisors; the checkpoint's own parameters come
    back from them (the end-to-end test above has too few frequencies for that: any
    parameters giving the same divisors are as good)."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, **rope}
    factors = llama3_rope_factors(rope, head_dim).tolist()
    assert _llama3_from_factors(factors, 500000.0, head_dim) == rope
    assert _llama3_from_factors([1.0] * (head_dim // 2), 500000.0, head_dim) is None
    with pytest.raises(ValueError, match="not Llama 3 rope scaling"):
        _llama3_from_factors([1.0, 3.0, 1.5] + [8.0] * (head_dim // 2 - 3), 500000.0, head_dim)


UNSUPPORTED = [
    ("mamba", {}, "GGUF architecture 'mamba' is not supported"),
    ("gpt2", {}, "GGUF architecture 'gpt2' is not supported"),
    ("falcon", {}, "GGUF architecture 'falcon' is not supported"),
    ("llama", {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0},
     "GGUF rope scaling 'yarn' of llama is not supported"),
    ("phi3", {"phi3.rope.dimension_count": 8}, "partial_rotary_factor=0.5"),
]


@pytest.mark.parametrize("arch, kv, message", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_an_unsupported_gguf_is_refused_in_one_line(tmp_path, arch, kv, message):
    path = write_header_only_gguf(tmp_path / f"x-{arch}.gguf", arch, kv)
    with pytest.raises(ValueError, match=message) as info:
        check_model_dir(str(path))
    assert "\n" not in str(info.value) and str(info.value).startswith(path.name)


def test_not_a_gguf_is_refused_in_one_line(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file") as info:
        check_model_dir(str(path))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("command", [["serve", "prefill"], ["up"]])
def test_serve_and_up_refuse_an_unsupported_gguf_with_exit_2(tmp_path, command):
    """Refused from the header before anything is converted or started: one line, exit 2."""
    path = write_header_only_gguf(tmp_path / "tiny-mamba.gguf", "mamba")
    cache = tmp_path / "cache"
    done = subprocess.run([sys.executable, "-m", "pdserve.services.cli", *command,
                           "--model", str(path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1",
                               "PDSERVE_CACHE_DIR": str(cache)})
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    lines = [line for line in out.splitlines() if "GGUF architecture 'mamba'" in line]
    assert len(lines) == 1 and "Traceback" not in out, out
    assert not cache.exists()  # nothing converted


def test_the_header_reader_agrees_with_gguf_py():
    """gguf_check's own header reader against gguf-py's GGUFReader on SmolLM2's Q4_1 file."""
    from pdserve.shared.models.convert import find_smollm2_gguf
    from pdserve.shared.models.gguf_check import read_gguf_header

    path = find_smollm2_gguf()
    header, reader = read_gguf_header(path), gguf.GGUFReader(path)
    assert header.data_start == reader.data_offset
    assert {t.name: (tuple(int(d) for d in reversed(t.shape)), int(t.tensor_type),
                     int(t.data_offset) - reader.data_offset) for t in reader.tensors} == \
        header.tensors
    for key in ("general.architecture", "llama.context_length", "llama.rope.freq_base",
                "tokenizer.ggml.eos_token_id"):
        assert header.metadata[key] == reader.fields[key].contents()
    assert header.metadata["tokenizer.ggml.tokens"] == len(
        reader.fields["tokenizer.ggml.tokens"].data)


def test_a_conversion_parses_the_file_and_builds_name_maps_once():
    """transformers' loader asks for a GGUFReader three times and a TensorNameMap once per
    module: while converting, the same objects come back (same file, same arguments), and
    gguf-py's own functions are restored afterwards."""
    from pdserve.shared.models.convert import _fast_gguf_reader, find_smollm2_gguf

    path = find_smollm2_gguf()
    base_reader, base_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _fast_gguf_reader():
        reader = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is reader
        assert reader.fields["general.architecture"].contents() == "llama"
        name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30) is name_map
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is not name_map
        assert name_map.get_name("model.layers.3.self_attn.q_proj") == "blk.3.attn_q"
    assert gguf.GGUFReader is base_reader and gguf.get_tensor_name_map is base_name_map
