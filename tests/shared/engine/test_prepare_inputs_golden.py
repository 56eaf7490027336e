"""ModelRunner.prepare_inputs on a worked example, every tensor written out by hand.

block_size 4; the scheduler lists decodes first, then prefill chunks:

    A  decode: 7 prompt + 6 output tokens, 12 of the 13 with KV; runs position 12 (its
       last token, 403); block_ids [5, 2, 8, 7]
    B  prefill: 10 prompt tokens, the first 4 (one full block) a prefix-cache hit;
       runs positions 4..9, its last chunk, so it samples; block_ids [9, 4, 6]

    batch row   0  | 1    2    3    4    5    6
    request     A  | B    B    B    B    B    B
    position    12 | 4    5    6    7    8    9
    block       7  | 4    4    4    4    6    6      block_ids[position // 4]
    offset      0  | 0    1    2    3    0    1      position % 4
    slot        28 | 16   17   18   19   24   25     block * 4 + offset

    query_start_loc [0, 1, 7]         cumsum of q_lens [1, 6]
    seq_lens        [13, 10]          start_pos + q_len: 12 + 1, 4 + 6
    logits_indices  [0, 6]            each sampling request's last row: query_start_loc[1:] - 1
"""

from __future__ import annotations

import torch

from pdserve.shared.engine.model_runner import ModelRunner
from pdserve.shared.engine.scheduler_output import ScheduledRequest
from pdserve.shared.request import Request
from pdserve.shared.sampling_params import SamplingParams


def test_prepare_inputs_worked_example() -> None:
    a = Request("A", [101, 102, 103, 104, 105, 106, 107], SamplingParams(),
                output_token_ids=[201, 202, 203, 401, 402, 403], num_computed_tokens=12)
    b = Request("B", list(range(301, 311)), SamplingParams(), num_computed_tokens=4)
    scheduled = [ScheduledRequest(a, 12, 1, [5, 2, 8, 7], sample=True),
                 ScheduledRequest(b, 4, 6, [9, 4, 6], sample=True)]
    runner = ModelRunner.__new__(ModelRunner)  # prepare_inputs reads only these two
    runner.block_size, runner.device = 4, torch.device("cpu")

    inputs = runner.prepare_inputs(scheduled)

    def expect(tensor: torch.Tensor, values: list, dtype: torch.dtype) -> None:
        assert tensor.dtype == dtype
        assert tensor.tolist() == values

    expect(inputs.input_ids, [403, 305, 306, 307, 308, 309, 310], torch.int64)
    expect(inputs.positions, [12, 4, 5, 6, 7, 8, 9], torch.int64)
    meta = inputs.attn_metadata
    expect(meta.slot_mapping, [28, 16, 17, 18, 19, 24, 25], torch.int64)
    expect(meta.block_table, [[5, 2, 8, 7], [9, 4, 6, 0]], torch.int32)  # 0: the null block
    expect(meta.seq_lens, [13, 10], torch.int32)
    expect(meta.query_start_loc, [0, 1, 7], torch.int32)
    assert (meta.max_query_len, meta.max_seq_len, meta.verify_reqs) == (6, 13, frozenset())
    expect(inputs.logits_indices, [0, 6], torch.int64)
    assert inputs.sampled_requests == [a, b]
    assert inputs.prompt_logprobs_jobs == [] and inputs.draft_rows is None
