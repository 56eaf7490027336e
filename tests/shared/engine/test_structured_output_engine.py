"""Guided decoding in the engine core: a half-guided batch of 32 leaves its unguided rows
token-identical to a run without guided neighbours; guided rows (greedy and seeded
temperature 1) validate; max_tokens ends a guided output with "length"; preempted guided
requests resume their grammar (same tokens); a grammar stuck compiling holds back only its
own request (AsyncEngine). (Regex, choice and grammars run end to end in
tests/e2e/test_structured_outputs.py.)"""

from __future__ import annotations

import asyncio
import json
import threading

import jsonschema
import pytest

from pdserve.shared.llm import LLM
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.structured_output.params import StructuredOutputsParams

SCHEMA = {"type": "object",
          "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]},
                                  "minItems": 1, "maxItems": 2}},
          "required": ["age", "pets"]}
GUIDED = StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True)
TOPICS = ["a baker", "a pilot", "a farmer", "a nurse", "a painter", "a sailor", "a teacher",
          "a chef"]


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, kv_cache_memory="256MiB", max_model_len=512, max_num_seqs=32)


def _conversation(i: int) -> list[dict]:
    topic = TOPICS[i % len(TOPICS)]
    return [{"role": "user", "content": f"JSON: age and pets of {topic} ({i})."}]


def _params(i: int, guided: bool) -> SamplingParams:
    # Rows cycle through greedy and seeded temperature 1, guided or not.
    sampled = (i // 2) % 2 == 1
    return SamplingParams(temperature=1.0 if sampled else 0.0, seed=1000 + i if sampled else None,
                          max_tokens=40 if guided else 16,
                          structured_outputs=GUIDED if guided else None)


def test_unguided_rows_are_identical_with_and_without_guided_neighbours(llm):
    rows = list(range(32))
    guided = [i % 2 == 0 for i in rows]
    mixed = llm.chat([_conversation(i) for i in rows],
                     [_params(i, g) for i, g in zip(rows, guided)])
    plain_rows = [i for i in rows if not guided[i]]
    alone = llm.chat([_conversation(i) for i in plain_rows],
                     [_params(i, False) for i in plain_rows])
    assert [mixed[i].outputs[0].token_ids for i in plain_rows] == \
        [o.outputs[0].token_ids for o in alone]
    for i in rows:
        if guided[i]:
            out = mixed[i].outputs[0]
            assert out.finish_reason == "stop", (i, out.text)
            jsonschema.validate(json.loads(out.text), SCHEMA)
            assert out.token_ids[-1] == llm.eos_token_id  # EOS only once the grammar accepts


def test_max_tokens_ends_a_guided_output_with_length(llm):
    out = llm.chat(_conversation(0), SamplingParams(temperature=0, max_tokens=4,
                                                    structured_outputs=GUIDED))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.text.startswith("{")


def test_a_bad_grammar_is_refused_before_anything_is_queued(llm):
    with pytest.raises(ValueError, match="invalid regex"):
        llm.chat(_conversation(0), SamplingParams(
            max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(unclosed")))
    assert not llm.engine.has_unfinished_requests()


async def test_a_slow_compile_holds_back_only_its_own_request(model_path):
    """While one schema's compile is stuck (held on its compile thread), an unguided request,
    a guided one whose grammar is cached and one with another new grammar run to the end;
    released, the slow one does."""
    from pdserve.shared.engine.async_engine import AsyncEngine
    from pdserve.shared.request import Request

    llm = LLM(model_path, kv_cache_memory="32MiB", max_model_len=256, max_num_seqs=4)
    manager = llm.engine.structured_output
    slow = StructuredOutputsParams(json=json.dumps({**SCHEMA, "title": "slow"}),
                                   disable_any_whitespace=True)
    gate, entered = threading.Event(), threading.Event()
    compile_fn = manager.backend.compile

    def held_compile(params):
        if params.json == slow.json:
            entered.set()
            assert gate.wait(60)
        return compile_fn(params)

    manager.backend.compile = held_compile
    manager.grammar(GUIDED).result(60)  # cached before the slow one takes the thread
    engine = AsyncEngine(llm.engine, name="slow-compile")
    prompt = llm.tokenizer.encode("JSON: age and pets of a baker.")

    async def run(request_id: str, guided) -> list:
        params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=guided)
        return [d async for d in engine.generate(Request(request_id, prompt, params))]

    try:
        waiting = asyncio.ensure_future(run("slow", slow))
        assert await asyncio.to_thread(entered.wait, 60)
        fresh = StructuredOutputsParams(json=json.dumps({**SCHEMA, "title": "fresh"}),
                                        disable_any_whitespace=True)
        others = await asyncio.wait_for(asyncio.gather(
            run("plain", None), run("cached", GUIDED), run("fresh", fresh)), 120)
        assert all(deltas[-1].finished for deltas in others) and not waiting.done()
        gate.set()
        assert (await asyncio.wait_for(waiting, 120))[-1].finished
    finally:
        gate.set()
        await asyncio.to_thread(engine.shutdown)


def test_preempted_guided_requests_resume_their_grammar(llm, model_path):
    """Guided requests (greedy and seeded) preempted again and again in a pool too small for
    all of them give the tokens they give unpreempted, and validate."""
    rows = list(range(8))
    conversations = [_conversation(i) for i in rows]
    params = [_params(i, True) for i in rows]
    roomy = llm.chat(conversations, params)
    small = LLM(model_path, num_gpu_blocks_override=20, max_num_seqs=8, max_model_len=256,
                enable_prefix_caching=False)
    try:
        tight = small.chat(conversations, params)
        preemptions = small.engine.scheduler.num_preemptions
    finally:
        del small
    assert preemptions > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
    for o in tight:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
