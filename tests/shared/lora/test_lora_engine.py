"""Multi-LoRA serving through `LLM` against transformers + PEFT fp32 (issue 31).

A tiny random Llama (tests/shared/models/test_architectures.py's `build_checkpoint`) and three
PEFT adapters with random non-zero A and B (ranks 8 and 16, different target modules, one
rsLoRA): greedy tokens equal PEFT's alone, batched with each other and the base model in one
step, with prefix-cache hits, and under forced preemption with fewer slots than adapters. The
same prompt under two adapters never shares a cached block; bad adapters are refused in one
line and nothing loaded is harmed.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pdserve.shared.kv_cache.prefix_hash import block_extra_keys, hash_request_tokens
from pdserve.shared.llm import LLM
from pdserve.shared.request import Request
from pdserve.shared.sampling_params import SamplingParams
from tests.shared.lora.adapters import lora, make_adapter, peft_greedy
from tests.shared.models.test_architectures import build_checkpoint

pytestmark = pytest.mark.fp32_only  # the reference is transformers + PEFT in fp32

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name: (id, rank, target modules, rsLoRA)
    "qv8": (1, 8, ["q_proj", "v_proj"], False),
    "all16": (2, 16, ALL, True),
    "mlp8": (3, 8, ["o_proj", "gate_proj", "down_proj"], False),
}
MAX_TOKENS = 12


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(checkpoint dir, base transformers model, {name: LoRARequest}, prompts, references
    {name or None: tokens per prompt})."""
    root = tmp_path_factory.mktemp("lora")
    base = build_checkpoint(root / "ckpt", "LlamaConfig", tie_word_embeddings=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 37)]
    requests, refs = {}, {None: peft_greedy(base, None, prompts, MAX_TOKENS)}
    for i, (name, (lora_id, rank, targets, rslora)) in enumerate(ADAPTERS.items()):
        path = make_adapter(root / name, base, rank, targets, seed=10 + i, use_rslora=rslora)
        requests[name] = lora(name, lora_id, path)
        refs[name] = peft_greedy(base, path, prompts, MAX_TOKENS)
    assert len({tuple(r[0]) for r in refs.values()}) == 4, "adapters must change the tokens"
    return root, base, requests, prompts, refs


@pytest.fixture(scope="module")
def llm(setup):
    root, _, loras, _, _ = setup
    llm = LLM(str(root / "ckpt"), kv_cache_memory="64MiB", max_model_len=512,
              enable_lora=True, max_loras=3, max_lora_rank=16)
    for lora_request in loras.values():
        llm.engine.add_lora(lora_request)
    return llm


def record_steps(llm: LLM) -> list[set[int]]:
    """Each later step's adapter ids (0: the base model)."""
    runner, steps = llm.engine.model_runner, []
    execute = runner.execute_model

    def spy(scheduler_output):
        steps.append({s.request.lora_request.lora_int_id if s.request.lora_request else 0
                      for s in scheduler_output.scheduled})
        return execute(scheduler_output)

    runner.execute_model = spy
    return steps


def test_alone_batched_in_one_step_and_cached_equal_peft(llm, setup):
    _, _, loras, prompts, refs = setup
    for name, lora_request in loras.items():
        outs = llm.generate(prompts, greedy(), lora_request=lora_request)
        assert [o.outputs[0].token_ids for o in outs] == refs[name], name
    steps = record_steps(llm)
    names = [*loras, None]
    outs = llm.generate([p for _ in names for p in prompts], greedy(),
                        lora_request=[loras.get(n) for n in names for _ in prompts])
    assert [o.outputs[0].token_ids for o in outs] == [t for n in names for t in refs[n]]
    assert {0, 1, 2, 3} in steps, steps  # all three adapters and the base in one step
    hit = llm.generate([prompts[1]], greedy(), lora_request=loras["all16"])[0]
    assert hit.num_cached_tokens >= 32 and hit.outputs[0].token_ids == refs["all16"][1]


def test_the_same_prompt_under_two_adapters_never_shares_a_block(llm, setup):
    loras = setup[2]
    engine = llm.engine
    prompt = list(range(100, 148))  # 3 full blocks
    users = {"a": loras["qv8"], "b": loras["all16"], "base": None}
    for rid, lora_request in users.items():
        engine.add_request(Request(rid, prompt, greedy(2), lora_request=lora_request))
    engine.step()  # all three prefill in this step
    kv = engine.kv_cache_manager
    blocks = {rid: set(kv.get_block_ids(rid)) for rid in users}
    hashes = {rid: set(engine.scheduler.requests[rid].block_hashes) for rid in users}
    for x, y in (("a", "b"), ("a", "base"), ("b", "base")):
        assert not blocks[x] & blocks[y] and not hashes[x] & hashes[y], (x, y)
    # the base model's hashes are those of before LoRA existed
    assert engine.scheduler.requests["base"].block_hashes == hash_request_tokens(
        prompt, 16, block_extra_keys(llm.model_config.served_model_name, None))
    while engine.has_unfinished_requests():
        engine.step()
    again = llm.generate([prompt], greedy(2), lora_request=loras["qv8"])[0]
    other = llm.generate([prompt], greedy(2), lora_request=loras["mlp8"])[0]
    assert again.num_cached_tokens == 32 and other.num_cached_tokens == 0  # hits stop at 47


def test_bad_adapters_are_refused_in_one_line_and_nothing_is_harmed(llm, setup, tmp_path):
    root, base, loras, prompts, refs = setup
    good = root / "qv8"

    def variant(name: str, **config) -> str:
        path = tmp_path / name
        shutil.copytree(good, path)
        cfg = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
        return str(path)

    no_weights = variant("no_weights")
    (tmp_path / "no_weights" / "adapter_model.safetensors").unlink()
    small = build_checkpoint(tmp_path / "small", "LlamaConfig", hidden_size=32,
                             intermediate_size=64)
    cases = [
        (str(tmp_path / "missing"), "no adapter_config.json in"),
        (no_weights, "no adapter_model.safetensors in"),
        (str(make_adapter(tmp_path / "other", small, 8, ["q_proj"], seed=5)),
         r"has A \[8, 32\] and B \[32, 8\], the model needs \[8, 64\] and \[64, 8\]: an "
         "adapter of another base model"),
        (variant("rank", r=32), "rank 32 is over max_lora_rank=16"),
        (variant("head", target_modules=["lm_head"]), "target module 'lm_head' is not supported"),
        (variant("dora", use_dora=True), "use_dora=True is not supported"),
        (variant("bias", bias="all"), "bias='all' is not supported"),
    ]
    before = llm.engine.list_loras()
    for i, (path, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message) as info:
            llm.engine.add_lora(lora(f"bad{i}", 10 + i, path))
        assert "\n" not in str(info.value)
        assert llm.engine.list_loras() == before
    with pytest.raises(ValueError, match="lora_int_id 1 is already loaded as 'qv8'"):
        llm.engine.add_lora(lora("other", 1, str(root / "mlp8")))
    with pytest.raises(ValueError, match="is not loaded"):
        llm.engine.add_request(Request("x", prompts[0], greedy(), lora_request=lora(
            "nobody", 99, str(good))))
    outs = llm.generate(prompts, greedy(), lora_request=loras["qv8"])
    assert [o.outputs[0].token_ids for o in outs] == refs["qv8"]


def test_adapters_past_max_cpu_loras_are_evicted_and_read_again(llm, setup):
    root, _, loras, prompts, refs = setup
    manager = llm.engine.model_runner.lora_manager
    llm.engine.add_lora(lora("qv8-copy", 4, root / "qv8"))  # a 4th: max_cpu_loras is 3
    assert len(manager.loaded) == 3 and llm.engine.list_loras() == {1, 2, 3, 4}
    evicted = ({1, 2, 3} - set(manager.loaded)).pop()
    name = next(n for n, r in loras.items() if r.lora_int_id == evicted)
    out = llm.generate([prompts[0]], greedy(), lora_request=loras[name])[0]
    assert out.outputs[0].token_ids == refs[name][0] and evicted in manager.loaded
    assert llm.engine.remove_lora(4) and llm.engine.list_loras() == {1, 2, 3}


def test_an_adapter_in_use_is_not_removed(llm, setup):
    loras, prompts = setup[2], setup[3]
    engine = llm.engine
    engine.add_request(Request("user", prompts[0], greedy(), lora_request=loras["mlp8"]))
    assert engine.lora_stats() == ([], ["mlp8"], 3)
    with pytest.raises(ValueError, match="used by 1 unfinished request"):
        engine.remove_lora(3)
    engine.abort_requests(["user"])
    assert engine.remove_lora(3) and not engine.remove_lora(3)
    with pytest.raises(ValueError, match="'mlp8' \\(id 3\\) is not loaded"):
        engine.add_request(Request("late", prompts[0], greedy(), lora_request=loras["mlp8"]))
    engine.add_lora(loras["mlp8"])


def test_forced_preemption_with_fewer_slots_than_adapters(setup):
    root, base, loras, _, _ = setup
    g = torch.Generator().manual_seed(2)
    batch = [torch.randint(3, 49152, (30,), generator=g).tolist() for _ in range(8)]
    names = ["qv8", "all16", "mlp8", None] * 2
    want = {n: peft_greedy(base, root / n if n else None, batch[i::4], 50)
            for i, n in enumerate(names[:4])}
    llm = LLM(str(root / "ckpt"), num_gpu_blocks_override=24, max_model_len=512,
              enable_prefix_caching=False, enable_lora=True, max_loras=2)
    steps = record_steps(llm)
    outs = llm.generate(batch, greedy(50), lora_request=[loras.get(n) for n in names])
    for i, n in enumerate(names):
        assert outs[i].outputs[0].token_ids == want[n][i // 4], (i, n)
    assert llm.engine.scheduler.num_preemptions > 0
    assert max(len(s - {0}) for s in steps) == 2  # never more adapters than slots


def test_lora_on_the_int8_base(setup):
    """int8 weights with fp32 adapters: an all-zero adapter leaves the tokens exactly as the
    base; each LoRA layer adds exactly x A^T B^T to the int8 layer's output."""
    root, base, loras, prompts, _ = setup
    zero = make_adapter(root / "zero", base, 8, ALL, seed=0, std=0.0)
    llm = LLM(str(root / "ckpt"), kv_cache_memory="64MiB", max_model_len=512,
              quantization="int8", enable_lora=True, max_loras=2)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy())]
    outs = llm.generate(prompts, greedy(), lora_request=lora("zero", 7, zero))
    assert [o.outputs[0].token_ids for o in outs] == plain
    outs = llm.generate(prompts, greedy(), lora_request=loras["all16"])
    assert [o.outputs[0].token_ids for o in outs] != plain
    manager = llm.engine.model_runner.lora_manager
    slot = manager.slot_ids.index(2)
    layer = manager.layers[1]["gate_up_proj"]
    weights = manager.loaded[2].layers[1]["gate_up_proj"]
    x = torch.randn(5, 64)
    from pdserve.shared.lora.mapping import build_lora_mapping

    with torch.inference_mode(), manager.context.step(
            build_lora_mapping([slot, -1], torch.tensor([3, 2]).numpy(), torch.device("cpu"))):
        got = layer(x)
    want = layer.base_layer(x)
    want[:3] += x[:3] @ weights.lora_a.t() @ weights.lora_b.t()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_adapters_removed_and_added_again_between_steps(llm, setup):
    """A load / unload storm on one engine: before every step each adapter is removed when no
    request uses it (refused otherwise) and added back at once; requests arrive in two
    waves. Every answer equals PEFT's, and every block is free at the end."""
    _, _, loras, prompts, refs = setup
    engine = llm.engine
    requests: list[tuple[Request, list[int]]] = []
    num_removed = 0
    for wave in range(2):
        for n, max_tokens in zip([*loras, None], (3, 6, 9, 12)):  # adapters free up in turn
            for i, p in enumerate(prompts):
                request = Request(f"storm{wave}-{n}-{i}", p, greedy(max_tokens),
                                  lora_request=loras.get(n))
                engine.add_request(request)
                requests.append((request, refs[n][i][:max_tokens]))
        for _ in range(5) if wave == 0 else iter(engine.has_unfinished_requests, False):
            for lora_request in loras.values():
                try:
                    assert engine.remove_lora(lora_request.lora_int_id)
                except ValueError:
                    continue
                num_removed += 1
                engine.add_lora(lora_request)
            engine.step()
    assert num_removed > 0
    assert [r.output_token_ids for r, _ in requests] == [want for _, want in requests]
    engine.kv_cache_manager.check_invariants()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_gpu_blocks - 1
