"""Grammar-constrained decoding in the engine, with the real default model (LLM.generate).

The 50 schemas of schema_suite.py, greedy and at temperature 1: every output must parse and
validate with the `jsonschema` package (formats checked). Then regex, choice and Lark grammars,
a grammar that cannot finish in max_tokens (finish "length", a valid prefix), bad specs refused
with a message naming the path or keyword, and batch invariance of unconstrained rows.
"""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest
from schema_suite import schemas

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequest
from kvserve.model.loader import load_model
from kvserve.sampling_params import StructuredOutputsParams as SO
from kvserve.structured.grammar import build_grammar


@pytest.fixture(scope="module")
def llm() -> LLM:
    loaded = load_model(None)
    return LLM(loaded.model, tokenizer=loaded.tokenizer, max_num_seqs=64)


def chat(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}]),
                                add_special_tokens=False)


def ask_json(llm: LLM, schema: dict) -> list[int]:
    return chat(llm, f"Reply with one JSON value that follows this JSON schema:\n{json.dumps(schema)}")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fifty_schemas_parse_and_validate(llm, temperature):
    suite = schemas()
    prompts = [ask_json(llm, s) for s in suite]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=400, structured_outputs=SO(json=s))
              for i, s in enumerate(suite)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    bad = []
    for i, (schema, out) in enumerate(zip(suite, outs)):
        c = out.outputs[0]
        try:
            value = json.loads(c.text)
            jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(value)
        except (ValueError, jsonschema.ValidationError) as e:
            bad.append((i, c.finish_reason, c.text[:200], str(e)[:200]))
            continue
        assert c.finish_reason == "stop", (i, c.finish_reason)
    assert not bad, bad


def test_regex_choice_and_lark(llm):
    p = chat(llm, "Give me a phone number.")
    cases = [
        (SO(regex=r"[0-9]{3}-[0-9]{4}"), lambda t: len(t) == 8 and t[3] == "-" and (t[:3] + t[4:]).isdigit()),
        (SO(choice=["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
        (SO(grammar='start: "call " NUM " now"\nNUM: /[1-9][0-9]{2}/'),
         lambda t: t.startswith("call ") and t.endswith(" now") and t[5:8].isdigit()),
        (SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    outs = llm.generate([p] * len(cases), [SamplingParams(temperature=0, max_tokens=120, structured_outputs=so)
                                           for so, _ in cases], use_tqdm=False)
    for (so, ok), out in zip(cases, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and ok(c.text), (so, c.text, c.finish_reason)


def test_grammar_that_cannot_finish_ends_with_length_and_a_valid_prefix(llm):
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer"},
                                                         "minItems": 50}}, "required": ["items"]}
    out = llm.generate([ask_json(llm, schema)], SamplingParams(temperature=0, max_tokens=12,
                                                              structured_outputs=SO(json=schema)), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 12
    tok = llm.get_tokenizer()
    lltok = llguidance.LLTokenizer(tok.hf.to_str(), n_vocab=llm.engine.info.vocab_size)
    m = llguidance.LLMatcher(lltok, build_grammar(SO(json=schema)))
    assert m.try_consume_tokens(list(c.token_ids)) == 12 and not m.is_error()     # a valid prefix


def test_unconstrained_rows_do_not_depend_on_constrained_neighbours(llm):
    plain = chat(llm, "Write one sentence about the sea.")
    alone = llm.generate([plain], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    schema = schemas()[5]
    mixed = llm.generate([ask_json(llm, schema), plain, ask_json(llm, schemas()[20])],
                         [SamplingParams(temperature=0, max_tokens=24, structured_outputs=SO(json=schema)),
                          SamplingParams(temperature=0, max_tokens=24),
                          SamplingParams(temperature=0, max_tokens=24, structured_outputs=SO(json=schemas()[20]))],
                         use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.parametrize("spec, param, words", [
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "structured_outputs.properties.a.type",
     ["strin"]),
    ({"type": "object", "properties": {"a": {"type": "array", "minItems": -1}}},
     "structured_outputs.properties.a.minItems", ["-1"]),
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
     "structured_outputs.properties.a.uniqueItems", ["uniqueItems"]),
    ({"type": "object", "properties": {"b": {"if": {"type": "string"}, "then": {}}}},
     "structured_outputs.properties.b.if", ["'if'"]),
])
def test_bad_schemas_name_the_path_or_keyword(llm, spec, param, words):
    with pytest.raises(InvalidRequest) as e:
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=SO(json=spec)), use_tqdm=False)
    assert e.value.param == param and all(w in e.value.message for w in words), (e.value.param, e.value.message)


def test_bad_grammars_and_specs_are_refused(llm):
    for so in ({"grammar": "start: foo\n"}, {"regex": "(unclosed"}, {"grammar": "\u8a0e\u00b8c@QD ag"}):
        with pytest.raises(InvalidRequest) as e:
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
        assert "does not compile" in e.value.message
    with pytest.raises(InvalidRequest):
        SO(json={"type": "object"}, regex="a")
    with pytest.raises(InvalidRequest):
        SO(choice=[])


def test_reasoning_budget_closes_the_block_and_the_grammar_applies_after(llm):
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Is 7 prime? Answer yes or no."}]) + "<think>\n"
    ids = tok.encode(prompt, add_special_tokens=False)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=60, reasoning_budget=8, logprobs=0,
                                             structured_outputs=SO(choice=["yes", "no"])), use_tqdm=False)[0]
    c = out.outputs[0]
    thought, sep, answer = c.text.partition("</think>")
    assert sep and answer.strip() in ("yes", "no") and c.finish_reason == "stop", c.text
    assert len(tok.encode(thought, add_special_tokens=False)) <= 9      # 8 tokens, then the forced end
    assert len(c.logprobs) == len(c.token_ids)                           # forced tokens have entries too
