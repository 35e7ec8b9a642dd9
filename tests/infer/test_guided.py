"""Constrained decoding through llguidance on the real SmolLM2 tokenizer: masks allow exactly
the tokens that keep the output in the grammar, engine outputs under a JSON schema always
parse and validate (greedy and sampled, with a random model that would never write JSON on
its own), choices and regexes hold, bad schemas are refused with the reason, and a parser
failure ends the request instead of the engine."""

import json
import re

import jsonschema
import pytest
import torch

from llmopt.infer.batch import EngineConfig, SamplingParams, ServingEngine
from llmopt.infer.guided import GrammarCompiler, GrammarError
from llmopt.models import build_model
from tests.tiny_models import smol_config

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99},
        "label": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["id", "label", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok.backend.to_str(), 49152, [tok.eos_token_id])


@pytest.fixture(scope="module")
def engine(tok):
    cfg = smol_config("g", max_seq_len=512)
    model = build_model(cfg, seed=1).eval()
    return ServingEngine(
        model,
        EngineConfig(num_blocks=128, block_size=16, runner="eager"),
        eos_token_id=tok.eos_token_id,
        detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True),
    )


def test_mask_allows_exactly_the_tokens_that_continue_the_grammar(tok, compiler):
    matcher = compiler.choice(["yes", "no"]).matcher()
    allowed = matcher.allowed()
    ids = allowed.nonzero().flatten().tolist()
    texts = {tok.decode([t]) for t in ids}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert tok.encode("yes")[0] in ids and tok.encode("no")[0] in ids
    assert not allowed[tok.eos_token_id]  # nothing is complete yet
    for token in tok.encode("yes"):
        matcher.advance(token)
    assert matcher.finished  # "yes" is a whole choice; nothing may follow


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_outputs_under_a_schema_always_validate(tok, compiler, engine, temperature):
    grammar = compiler.json_schema(SCHEMA)
    prompts = [tok.encode(p) for p in ("Give JSON:", "Record", "x")]
    params = [
        SamplingParams(max_tokens=150, temperature=temperature, seed=s, grammar=grammar)
        for s in range(3)
    ]
    outputs = engine.generate(prompts, params)
    texts = [tok.decode(o, skip_special_tokens=True) for o in outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    free = engine.generate(prompts[:1], SamplingParams(max_tokens=30))
    with pytest.raises(json.JSONDecodeError):  # unconstrained, the model writes no JSON
        json.loads(tok.decode(free[0], skip_special_tokens=True))
    engine.blocks.check_all_free()


def test_regex_and_choice_grammars(tok, compiler, engine):
    prompt = tok.encode("Date:")
    regex = compiler.regex(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]")
    choice = compiler.choice(["red", "green", "blue"])
    for seed in range(3):
        [date] = engine.generate(
            [prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=seed, grammar=regex)
        )
        assert re.fullmatch(r"20\d\d-(0[1-9]|1[0-2])-[0-3]\d", tok.decode(date))
        [colour] = engine.generate(
            [prompt], SamplingParams(max_tokens=5, temperature=1.0, seed=seed, grammar=choice)
        )
        assert tok.decode(colour) in ("red", "green", "blue")


def test_bad_schemas_are_refused_with_the_reason(compiler):
    with pytest.raises(GrammarError, match="invalid json schema"):
        compiler.json_schema({"type": "object", "properties": {"a": {"type": "nope"}}})
    with pytest.raises(GrammarError, match="invalid regex"):
        compiler.regex("(unclosed")
    with pytest.raises(GrammarError, match="invalid json schema"):  # unknown keywords too
        compiler.json_schema({"type": "string", "format": "no-such-format", "frobnicate": 1})


def test_a_parser_failure_ends_the_request_not_the_engine(tok, compiler):
    matcher = compiler.json_schema(SCHEMA).matcher()
    bad = tok.encode("hello")[0]  # JSON must start with "{"
    assert not matcher.allowed()[bad]
    matcher.advance(bad)  # refused: logged, and the matcher stops
    assert matcher.finished
    allowed = matcher.allowed()  # nothing would be allowed: EOS only, which ends the request
    assert allowed.nonzero().flatten().tolist() == [tok.eos_token_id]
    assert torch.is_tensor(allowed)


def test_properties_come_in_the_schemas_order(tok, compiler, engine):
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    [out] = engine.generate(
        [tok.encode("x")], SamplingParams(max_tokens=60, grammar=compiler.json_schema(schema))
    )
    assert list(json.loads(tok.decode(out, skip_special_tokens=True))) == ["zeta", "alpha"]
