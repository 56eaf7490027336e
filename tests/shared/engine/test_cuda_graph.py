"""The decode step's CUDA graphs (`shared/engine/cuda_graph.py`), as far as a CPU can check.

No CUDA here, so the capture itself runs on the GPU machine only (scripts/gpu_check.sh).
What does run here is everything around it: the buckets, the persistent buffers and the
padding, through the real model and KV cache, with a stand-in graph that re-runs the
captured forward eagerly over the same buffers on each replay (so a replay sees exactly the
buffer contents a CUDA graph would). The Triton kernels under the same padded batches run in
`tests/kernels/triton_interpret_checks.py` ("graph_padded_decode").
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from pdserve.kernels.attn_metadata import build_attn_metadata
from pdserve.shared.engine.cuda_graph import CUDAGraphRunner, default_capture_sizes
from pdserve.shared.engine_args import EngineArgs
from pdserve.shared.llm import LLM
from pdserve.shared.sampling_params import SamplingParams
from tests.conftest import NUM_PARITY_TOKENS


class EagerGraph:
    """Stand-in for `TorchCUDAGraph`: `output` is one static tensor, rewritten by each
    replay from the captured forward run again over the persistent buffers."""

    captured: list[int] = []

    def __init__(self, forward, pool) -> None:
        self.forward = forward
        self.output = forward().clone()
        EagerGraph.captured.append(self.output.shape[0])

    def replay(self) -> None:
        self.output.copy_(self.forward())


def install_graphs(llm: LLM, sizes: tuple[int, ...]) -> CUDAGraphRunner:
    runner = llm.engine.model_runner
    graphs = CUDAGraphRunner(
        runner.model, runner.kv_caches, runner.block_size, runner.args.num_kv_heads,
        llm.model_config.max_model_len, sizes, runner.device,
        attention_backend=runner.attention_backend, graph_factory=EagerGraph)
    graphs.capture()
    runner.cuda_graph_runner = graphs
    return graphs


def test_default_capture_sizes_follow_vllm() -> None:
    assert default_capture_sizes(128) == (1, 2, 4, *range(8, 129, 8))
    assert default_capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert default_capture_sizes(3) == (1, 2, 3)


def test_capture_sizes_resolve_per_device_and_flag() -> None:
    assert EngineArgs(device="cpu").resolve_cuda_graph_sizes() == ()
    assert EngineArgs(device="cuda", enforce_eager=True).resolve_cuda_graph_sizes() == ()
    assert EngineArgs(device="cuda", attention_backend="torch").resolve_cuda_graph_sizes() == ()
    assert EngineArgs(device="cuda", max_num_seqs=16).resolve_cuda_graph_sizes() == (
        1, 2, 4, 8, 16)
    args = EngineArgs(device="cuda", max_num_seqs=64, cuda_graph_sizes="8, 1,300 8")
    assert args.resolve_cuda_graph_sizes() == (1, 8)
    assert EngineArgs(device="cuda", max_num_seqs=4,
                      cuda_graph_sizes=[300]).resolve_cuda_graph_sizes() == (4,)
    for bad in ("0", "x", [-2]):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            EngineArgs(device="cuda", cuda_graph_sizes=bad).resolve_cuda_graph_sizes()


def test_cli_flags_and_environment(monkeypatch) -> None:
    def parse(*argv: str) -> EngineArgs:
        parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
        return EngineArgs.from_cli_args(parser.parse_args(list(argv)))

    args = parse("--device", "cuda", "--cuda-graph-sizes", "1", "2", "32")
    assert args.resolve_cuda_graph_sizes() == (1, 2, 32)
    assert parse("--device", "cuda", "--enforce-eager").resolve_cuda_graph_sizes() == ()
    monkeypatch.setenv("PDSERVE_ENFORCE_EAGER", "1")
    assert parse("--device", "cuda").enforce_eager is True
    monkeypatch.delenv("PDSERVE_ENFORCE_EAGER")
    monkeypatch.setenv("PDSERVE_CUDA_GRAPH_SIZES", "4 8")
    assert parse("--device", "cuda").resolve_cuda_graph_sizes() == (4, 8)


@pytest.fixture(scope="module")
def llm(model_path) -> LLM:
    return LLM(model_path, kv_cache_memory="128MiB", max_num_seqs=8)


def test_cpu_engine_captures_nothing(llm) -> None:
    assert llm.engine.model_runner.cuda_graph_runner is None


@pytest.mark.fp32_only
def test_graph_replays_match_transformers(llm, parity_prompt_ids, hf_greedy_reference) -> None:
    """Every pure-decode step of the batch replays a bucket: the 8 requests from bucket 10,
    2 padding rows each step, one request alone from bucket 1. The tokens stay
    transformers' own, token for token."""
    EagerGraph.captured = []
    graphs = install_graphs(llm, (1, 3, 10))
    try:
        assert EagerGraph.captured == [10, 3, 1]  # largest first
        greedy = SamplingParams(temperature=0.0, max_tokens=NUM_PARITY_TOKENS)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in parity_prompt_ids], greedy)
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy_reference
        batched_replays = graphs.num_replays
        # All but the prefill step's token and the mixed steps replayed.
        assert batched_replays >= NUM_PARITY_TOKENS - 2
        one = llm.generate({"prompt_token_ids": parity_prompt_ids[1]}, greedy)[0]
        assert one.outputs[0].token_ids == hf_greedy_reference[1]
        # One request alone: every decode step (all but the prefill's token) replays 1.
        assert graphs.num_replays - batched_replays == len(hf_greedy_reference[1]) - 1
    finally:
        llm.engine.model_runner.cuda_graph_runner = None
    llm.engine.kv_cache_manager.check_invariants()


def test_padding_writes_no_kv_and_replay_equals_eager(llm) -> None:
    """A step of 3 requests in bucket 4, right after a step of 4: the padded row must not
    write its stale slot (the previous step's), and the 3 rows equal the eager forward."""
    runner = llm.engine.model_runner
    graphs = install_graphs(llm, (4,))
    try:
        caches = runner.kv_caches
        block_ids = [[1, 2], [3], [4], [5]]

        def step(num_reqs: int, seq_len: int):
            starts = np.full(num_reqs, seq_len - 1, np.int64)
            meta, positions, _ = build_attn_metadata(
                starts, np.ones(num_reqs, np.int64), block_ids[:num_reqs], runner.block_size,
                runner.device)
            ids = torch.arange(100, 100 + num_reqs, dtype=torch.int64)
            return ids, positions, meta

        with torch.inference_mode():
            for k, v in caches:
                k.normal_()
                v.normal_()
            ids, positions, meta = step(4, 10)
            assert graphs.bucket(meta, 4) == 4
            graphs.run(ids, positions, meta, 4)
            before = [(k.clone(), v.clone()) for k, v in caches]
            ids, positions, meta = step(3, 11)
            batch = graphs.bucket(meta, 3)
            assert batch == 4
            replayed = graphs.run(ids, positions, meta, batch).clone()
            written = {int(s) for s in meta.slot_mapping}
            for (k0, v0), (k1, v1) in zip(before, caches):
                changed = ((k0 != k1) | (v0 != v1)).flatten(2).any(2).flatten()
                slots = set(changed.nonzero().flatten().tolist())
                assert slots == written  # request 4's slot from step 1 was not rewritten
            # The eager forward over the same caches (re-writing the same K/V) agrees.
            runner.cuda_graph_runner = None
            eager = runner.forward(ids, positions, meta)
            torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
            assert replayed.shape == (3, runner.args.hidden_size)
    finally:
        runner.cuda_graph_runner = None


def test_steps_that_cannot_replay_run_eagerly(llm) -> None:
    graphs = install_graphs(llm, (2,))
    try:
        def meta(q_lens, verify=frozenset()):
            n = len(q_lens)
            return build_attn_metadata(np.zeros(n, np.int64), np.array(q_lens, np.int64),
                                       [[1]] * n, 16, torch.device("cpu"), verify)[0]

        assert graphs.bucket(meta([1]), 1) == 2
        assert graphs.bucket(meta([1, 1]), 2) == 2
        assert graphs.bucket(meta([1, 1, 1]), 3) is None  # past the largest bucket
        assert graphs.bucket(meta([5, 1]), 6) is None  # a prefill chunk
        assert graphs.bucket(meta([1, 3], frozenset({1})), 4) is None  # drafts to verify
        with pytest.raises(ValueError, match="capture size"):
            CUDAGraphRunner(llm.engine.model_runner.model, [], 16, 1, 64, (), "cpu")
    finally:
        llm.engine.model_runner.cuda_graph_runner = None


def test_cuda_engine_args_read_transformers5_dtype_and_refuse_small_blocks(model_path) -> None:
    # transformers 5 writes "dtype" (SmolLM2's converted config.json has no "torch_dtype").
    auto = EngineArgs(dtype="auto", device="cuda")
    assert auto.resolve_dtype({"dtype": "bfloat16"}) == "bfloat16"
    assert auto.resolve_dtype({"torch_dtype": "float16", "dtype": "bfloat16"}) == "float16"
    assert auto.resolve_dtype({"dtype": "float32"}) == "float16"
    # The Triton kernels need blocks of at least 16: refused at start-up, not at a step.
    with pytest.raises(ValueError, match="at least 16"):
        EngineArgs(model=model_path, device="cuda", block_size=8).create_engine_configs()
    assert EngineArgs(model=model_path, block_size=8).create_engine_configs()[1].block_size == 8
