"""CUDA graphs for the decode step: one graph per batch-size bucket, captured at start-up,
replayed over persistent input buffers with the batch padded up to its bucket.

A decode step of a small model is hundreds of short kernel launches (per layer: norms,
matmuls, rotary, the KV store, attention); on a GPU the host's launch time, not the
arithmetic, then sets the step time. A graph replays the whole forward as one launch. As in
vLLM (`CUDAGraphRunner` in v0; `GPUModelRunner.capture_model` in v1):

- Only pure-decode steps run from a graph: every request schedules one token
  (`max_query_len == 1`), so a step of n requests has n tokens and the kernels' shapes depend
  on n alone. Prefill chunks, speculative verification and batches larger than the largest
  bucket run eagerly.
- Graphs are captured for a fixed list of batch sizes (`default_capture_sizes`: 1, 2, 4, then
  every multiple of 8 up to max_num_seqs), largest first, all sharing one memory pool. A step
  of n requests replays the smallest bucket >= n.
- The inputs live in persistent buffers sized for the largest bucket; each step copies its
  n rows in and pads the rest: padded tokens write no K/V (slot -1), and padded requests
  have q_len 0 (`query_start_loc` repeats n), so the attention kernels return at once for
  them. Output rows past n are discarded.
- The attention must read its lengths from device tensors only (the Triton kernels do: their
  grid is (requests, kv heads) and each program loads its own seq_len); the torch backend's
  host-side per-step indices cannot be captured.

Sampling stays outside the graph: it is per-request work on [n, vocab] logits.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from pdserve.kernels.attn_metadata import AttentionMetadata
from pdserve.shared.engine.attention import PagedAttention

logger = logging.getLogger(__name__)


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's default buckets: 1, 2, 4, then multiples of 8, up to and with max_num_seqs."""
    sizes = {1, 2, 4, *range(8, max_num_seqs + 1, 8), max_num_seqs}
    return tuple(sorted(s for s in sizes if 1 <= s <= max_num_seqs))


class Graph(Protocol):
    """A captured forward: `output` is its static result, rewritten by each `replay`."""

    output: torch.Tensor

    def replay(self) -> None: ...


GraphFactory = Callable[[Callable[[], torch.Tensor], object], Graph]
"""(forward, memory pool) -> a captured Graph."""


class TorchCUDAGraph:
    """`torch.cuda.CUDAGraph` capture of `forward` (run once eagerly before, so that Triton
    compiles and cuBLAS makes its handles outside the capture)."""

    def __init__(self, forward: Callable[[], torch.Tensor], pool: object) -> None:
        forward()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = forward()

    def replay(self) -> None:
        self.graph.replay()


class GraphInputs:
    """The persistent inputs every graph reads: each tensor sized for the largest bucket."""

    def __init__(self, max_batch: int, max_blocks_per_req: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(max_batch, dtype=torch.int64)
        self.positions = zeros(max_batch, dtype=torch.int64)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.block_table = zeros(max_batch, max_blocks_per_req, dtype=torch.int32)
        self.seq_lens = zeros(max_batch, dtype=torch.int32)
        self.query_start_loc = zeros(max_batch + 1, dtype=torch.int32)

    def metadata(self, batch: int, max_seq_len: int) -> AttentionMetadata:
        """The first `batch` rows as a decode step's metadata (views: replays see new data)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], block_table=self.block_table[:batch],
            seq_lens=self.seq_lens[:batch], query_start_loc=self.query_start_loc[:batch + 1],
            max_query_len=1, max_seq_len=max_seq_len)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata, batch: int) -> None:
        """Copy a decode step of n = len(input_ids) requests in; pad rows n..batch."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:batch].fill_(-1)
        self.block_table[:n, :meta.block_table.shape[1]].copy_(meta.block_table)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.query_start_loc[:n + 1].copy_(meta.query_start_loc)
        self.query_start_loc[n + 1:batch + 1].fill_(n)


class CUDAGraphRunner:
    """Captures `model`'s decode forward per bucket; `run` replays one for a decode step.

    Args:
        model: `LlamaForCausalLM` (its `forward(input_ids, positions, kv_caches, attn)`).
        kv_caches: the model runner's per-layer (k_cache, v_cache), captured by address.
        capture_sizes: batch sizes to capture (distinct, >= 1).
        max_model_len: sizes the block table buffer (`ceil(max_model_len / block_size)`).
        attention_backend: "triton" on CUDA (see the module docstring).
        graph_factory: how a forward is captured; `TorchCUDAGraph` (the default) needs a
            CUDA device. Unit tests on the CPU pass one that re-runs the forward eagerly.

    Raises:
        ValueError: no capture size.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list, block_size: int,
                 num_kv_heads: int, max_model_len: int, capture_sizes: Sequence[int],
                 device: torch.device, attention_backend: str = "triton",
                 graph_factory: GraphFactory | None = None) -> None:
        if not capture_sizes:
            raise ValueError("CUDA graphs need at least one capture size")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.max_model_len = max_model_len
        self.attention_backend = attention_backend
        self.capture_sizes = tuple(sorted(set(capture_sizes)))
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.inputs = GraphInputs(self.capture_sizes[-1], self.max_blocks_per_req, device)
        self.graph_factory = graph_factory or TorchCUDAGraph
        self.graphs: dict[int, Graph] = {}
        self.num_replays = 0
        """Steps run from a graph (the rest of the steps ran eagerly)."""

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs then reuse its pool's
        memory). The buffers hold no request while capturing: every slot is -1 and every
        q_len 0, so neither the warm-up run nor the capture touches the KV cache."""
        pool = torch.cuda.graph_pool_handle() if self.graph_factory is TorchCUDAGraph else None
        for batch in reversed(self.capture_sizes):
            self.graphs[batch] = self.graph_factory(self._forward_fn(batch), pool)
        logger.info("captured CUDA graphs for decode batch sizes %s", list(self.capture_sizes))

    def _forward_fn(self, batch: int) -> Callable[[], torch.Tensor]:
        inputs = self.inputs

        def forward() -> torch.Tensor:
            meta = inputs.metadata(batch, self.max_model_len)
            attn = PagedAttention(meta, self.attention_backend, self.block_size,
                                  self.num_kv_heads)
            return self.model(inputs.input_ids[:batch], inputs.positions[:batch],
                              self.kv_caches, attn)

        return forward

    def bucket(self, meta: AttentionMetadata, num_tokens: int) -> int | None:
        """The captured batch size a step replays, or None when it must run eagerly: not
        pure decode (a prefill chunk or speculative drafts), or more requests than the
        largest bucket."""
        if (meta.max_query_len != 1 or meta.verify_reqs or num_tokens > self.capture_sizes[-1]
                or meta.block_table.shape[1] > self.max_blocks_per_req):
            return None
        return self.capture_sizes[bisect.bisect_left(self.capture_sizes, num_tokens)]

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            batch: int) -> torch.Tensor:
        """Replay the `batch` graph (from `bucket`) for a decode step of n tokens.

        Args:
            input_ids, positions: [n] int64; meta: the step's metadata (n requests).

        Returns:
            [n, hidden_size] hidden states: a view of the graph's output buffer, valid until
            the next replay of any bucket (the graphs share one memory pool, so another
            bucket's replay may reuse this memory for its intermediates).
        """
        self.inputs.fill(input_ids, positions, meta, batch)
        graph = self.graphs[batch]
        graph.replay()
        self.num_replays += 1
        return graph.output[:input_ids.shape[0]]
