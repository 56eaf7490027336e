"""Guided decoding in the engine core: a half-guided batch of 32 leaves its unguided rows
token-identical to a run without guided neighbours; guided rows (greedy and seeded
temperature 1) validate; max_tokens ends a guided output with "length". (Regex, choice and
grammars run end to end in tests/e2e/test_structured_outputs.py.)"""

from __future__ import annotations

import json

import jsonschema
import pytest

from shared.llm import LLM
from shared.sampling_params import SamplingParams
from shared.structured_output.params import StructuredOutputsParams

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
