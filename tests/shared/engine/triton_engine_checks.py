"""The engine on the Triton backend, run by Triton's CPU interpreter; prints JSON.

Run by `test_triton_engine_interpret.py` in a subprocess (TRITON_INTERPRET=1 must be set
before triton is imported). argv[1]: a small model directory. Prints one JSON line: greedy
token ids per backend and case, and the triton run's prompt logprobs.
"""

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

from pdserve.shared.llm import LLM  # noqa: E402
from pdserve.shared.sampling_params import SamplingParams  # noqa: E402

# A 40-token prompt in chunks of 32 (a chunked prefill), one sharing its first block (a
# prefix-cache hit, shortest first), a short one; batched decodes after.
PROMPTS = [list(range(100, 140)), list(range(100, 120)) + [7, 8, 9], [5, 6, 7]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
         "prompt_lookup_min": 1}


def generate(model: str, backend: str, speculative_config: dict | None = None,
             prompt_logprobs: int | None = None, stats: dict | None = None) -> list:
    llm = LLM(model, attention_backend=backend, num_gpu_blocks_override=64,
              max_num_batched_tokens=32, speculative_config=speculative_config)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=prompt_logprobs)
    outputs = llm.generate(PROMPTS, params)
    if stats is not None:
        stats["num_draft_tokens"] = llm.engine.scheduler.spec_decoding_stats.num_draft_tokens
    if prompt_logprobs is not None:
        return [[None if lp is None else lp.logprob for lp in o.prompt_logprobs]
                for o in outputs]
    return [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    model = sys.argv[1]
    ngram_stats: dict = {}
    results = {
        "torch": generate(model, "torch"),
        "triton": generate(model, "triton"),
        "triton_ngram": generate(model, "triton", NGRAM, stats=ngram_stats),
        "torch_prompt_logprobs": generate(model, "torch", prompt_logprobs=0),
        "triton_prompt_logprobs": generate(model, "triton", prompt_logprobs=0),
    }
    results["ngram_stats"] = ngram_stats
    print(json.dumps(results))


if __name__ == "__main__":
    main()
