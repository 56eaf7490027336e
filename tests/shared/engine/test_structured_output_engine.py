"""Guided decoding in the engine core: a half-guided batch of 32 leaves its unguided rows
token-identical to a run without guided neighbours; guided rows (greedy and seeded
temperature 1) validate; max_tokens ends a guided output with "length"."""

from __future__ import annotations

import json

import jsonschema
import pytest

from shared.llm import LLM
from shared.sampling_params import SamplingParams
from shared.structured_output.params import StructuredOutputsParams

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]},
                                  "minItems": 1, "maxItems": 2}},
          "required": ["name", "age", "pets"]}
GUIDED = StructuredOutputsParams(json=json.dumps(SCHEMA))
TOPICS = ["a baker", "a pilot", "a farmer", "a nurse", "a painter", "a sailor", "a teacher",
          "a chef"]


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, kv_cache_memory="256MiB", max_model_len=512, max_num_seqs=32)


def _conversation(i: int) -> list[dict]:
    topic = TOPICS[i % len(TOPICS)]
    return [{"role": "user", "content": f"Describe {topic} (person {i}) as JSON with a name, "
                                        "an age and their pets."}]


def _params(i: int, guided: bool) -> SamplingParams:
    # Rows cycle through greedy and seeded temperature 1, guided or not.
    sampled = (i // 2) % 2 == 1
    return SamplingParams(temperature=1.0 if sampled else 0.0, seed=1000 + i if sampled else None,
                          max_tokens=60 if guided else 24,
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


def test_choice_and_regex_are_exact(llm):
    choice = StructuredOutputsParams(choice=("sunny", "rainy", "cloudy"))
    regex = StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}")
    outs = llm.chat([_conversation(1), _conversation(2)],
                    [SamplingParams(temperature=1.0, seed=7, max_tokens=10,
                                    structured_outputs=choice),
                     SamplingParams(temperature=0, max_tokens=12, structured_outputs=regex)])
    assert outs[0].outputs[0].text in choice.choice
    assert outs[0].outputs[0].finish_reason == "stop"
    assert len(outs[1].outputs[0].text) == 8 and outs[1].outputs[0].text[3] == "-"


def test_a_bad_grammar_is_refused_before_anything_is_queued(llm):
    with pytest.raises(ValueError, match="invalid regex"):
        llm.chat(_conversation(0), SamplingParams(
            max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(unclosed")))
    assert not llm.engine.has_unfinished_requests()
