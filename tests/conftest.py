"""Shared fixtures: the converted default model and the fixed prompts of the parity tests."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import os
import shutil

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# NOTE: the suite runs several engines (in this process and as children) on few cores. With
# libgomp's default spin-waiting, an OpenMP barrier whose partner thread lost its core waits a
# whole scheduler slice: a 37 ms decode step measured 1,270 ms at a load of 8, 91 ms with
# passive waiting. Set before torch (libgomp) loads; children inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The host weight cache (shared/models/weight_cache.py) of this run: engines in this process
# and the services it starts pack each checkpoint once and map it; removed at the end, so the
# many throw-away checkpoints of the tests leave nothing in ~/.cache.
_WEIGHT_CACHE_DIR = None
if "PDSERVE_WEIGHT_CACHE_DIR" not in os.environ:
    import tempfile

    _WEIGHT_CACHE_DIR = os.environ["PDSERVE_WEIGHT_CACHE_DIR"] = tempfile.mkdtemp(
        prefix="pdserve-weights-")


def pytest_sessionfinish(session, exitstatus) -> None:
    if _WEIGHT_CACHE_DIR is not None:
        shutil.rmtree(_WEIGHT_CACHE_DIR, ignore_errors=True)

TEST_QUANTIZATION = os.environ.get("PDSERVE_QUANTIZATION", "none")
"""The engines' weight mode for the whole suite: `PDSERVE_QUANTIZATION=int8 make test` runs
it with int8 weights (issue 17). Services started as processes read the variable themselves
(`--quantization`'s default); in-process engines (LLM, EngineArgs) take it as their default
here. Tests marked `fp32_only` (exact parity with transformers' fp32 model, or the fp32
default itself) are skipped in any other mode."""


TEST_DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")
"""The in-process engines' device for the whole run: `PDSERVE_TEST_DEVICE=cuda` runs the
parity suite on a GPU (scripts/gpu_check.sh), with `hf_greedy_reference` computed by
transformers in fp32 on the same device (TF32 off). Default cpu: CI never changes it."""


def _set_engine_args_default(name: str, value: str) -> None:
    """EngineArgs() defaults `name` to `value` in this process (a test-run setting, not an
    API)."""
    from pdserve.shared.engine_args import EngineArgs

    names = [f.name for f in dataclasses.fields(EngineArgs)]
    defaults = list(EngineArgs.__init__.__defaults__)
    defaults[names.index(name) - (len(names) - len(defaults))] = value
    EngineArgs.__init__.__defaults__ = tuple(defaults)
    assert getattr(EngineArgs(model="x"), name) == value


if TEST_QUANTIZATION != "none":
    _set_engine_args_default("quantization", TEST_QUANTIZATION)
if TEST_DEVICE != "cpu":
    _set_engine_args_default("device", TEST_DEVICE)


def pytest_collection_modifyitems(config, items) -> None:
    if TEST_QUANTIZATION == "none":
        return
    skip = pytest.mark.skip(reason=f"fp32 parity; this run is PDSERVE_QUANTIZATION="
                                   f"{TEST_QUANTIZATION}")
    for item in items:
        if item.get_closest_marker("fp32_only"):
            item.add_marker(skip)

# Eight chat prompts of different lengths whose greedy answers run long, so that 64 new
# tokens are compared for most of them (the engine-core parity test, reused by the
# services tests).
PARITY_MESSAGES: list[list[dict]] = [
    [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
    [{"role": "user", "content": "Explain how a bicycle gear system works."}],
    [{"role": "system", "content": "You are a patient teacher."},
     {"role": "user", "content": "Describe the water cycle step by step for a ten year old "
                                 "who has never heard of evaporation or condensation."}],
    [{"role": "user", "content": "List ten uses for a paperclip."}],
    [{"role": "user", "content": "What are the main differences between cats and dogs as "
                                 "pets? Consider cost, time, space, temperament, lifespan, "
                                 "allergies, training and how they fit into a family with "
                                 "small children living in a city apartment."}],
    [{"role": "user", "content": "Give me a recipe for pancakes."}],
    [{"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a poem about autumn leaves falling in a quiet park."}],
]

NUM_PARITY_TOKENS = int(os.environ.get("PDSERVE_PARITY_TOKENS", "64"))
"""New tokens compared per parity prompt. 64 always, except in scripts/gpu_check.sh's dry
run (8: it checks the step's plumbing on the CPU, where the suite itself runs in full)."""


@pytest.fixture(scope="module", autouse=True)
def _release_memory_after_each_module():
    """After each test module (its fixtures are torn down first): collect the reference
    cycles its engines left and hand the freed heap back to the OS. Without it the test
    process kept ~4 GB per in-process cluster (engines, KV pools, packed weights in cycles
    the collector had not reached yet) and the whole suite reached 19 GB of the 24 GiB CI
    machine, where the kernel killed it; with it, ~0.5 GB stays after a cluster closes."""
    yield
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the collection alone
        pass


@pytest.fixture(scope="session")
def model_path() -> str:
    """The converted SmolLM2-135M-Instruct directory (converted once if missing)."""
    from pdserve.shared.models.convert import resolve_model_path

    return str(resolve_model_path())


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from pdserve.shared.tokenizer import get_tokenizer

    return get_tokenizer(model_path)


@pytest.fixture(scope="session")
def parity_prompt_ids(tokenizer) -> list[list[int]]:
    from pdserve.shared.tokenizer import apply_chat_template

    return [apply_chat_template(tokenizer, m) for m in PARITY_MESSAGES]


def transformers_greedy(model_path: str, prompts: list[list[int]], device: str = "cpu",
                        dtype: str = "float32",
                        max_tokens: int = NUM_PARITY_TOKENS) -> list[list[int]]:
    """transformers `generate`, greedy, one prompt at a time (no padding in play): each
    prompt's new token ids, up to `max_tokens` or the EOS token (included). On CUDA, TF32 is
    turned off first (true fp32 matmuls; TF32 would make the reference itself drift).
    Also used by benchmarks/gpu_parity.py."""
    import torch
    from transformers import AutoModelForCausalLM

    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_tokens, pad_token_id=2)
            out.append(y[0, len(ids):].tolist())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


@pytest.fixture(scope="session")
def hf_greedy_reference(model_path, parity_prompt_ids) -> list[list[int]]:
    """transformers `generate` (greedy, fp32, one prompt at a time, on TEST_DEVICE): the new
    token ids, up to NUM_PARITY_TOKENS or the EOS token (included)."""
    return transformers_greedy(model_path, parity_prompt_ids, TEST_DEVICE)


@pytest.fixture(scope="session")
def draft_model_path(model_path, tmp_path_factory) -> str:
    """A draft model for speculative decoding: the default model cut to its first 2
    decoder layers (same tokenizer), in a temporary HF directory."""
    from tests.draft_model import write_truncated_model

    return write_truncated_model(model_path, tmp_path_factory.mktemp("draft_model"), 2)


# A real redis-server on a free port (the prefix index's tests under tests/shared and the
# service tests under tests/services; tests/e2e has its own).
@pytest.fixture(scope="session")
def redis_server():
    """None without the `redis-server` binary: the cluster then runs without the index
    (as the services do when Redis is unreachable) and the index checks skip."""
    if shutil.which("redis-server") is None:
        yield None
        return
    from tests.services.helpers import RedisServer

    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis(redis_server):
    if redis_server is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    return redis_server
