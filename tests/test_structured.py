"""Grammar-constrained decoding (runtime/api/structured.py) on SmolLM2's real 49,152-token vocabulary: random walks
through the masks must produce text the grammar's source accepts (jsonschema for schemas, re for regexes)."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import numpy as np
import pytest
from conftest import smollm2_tokenizer_json

from mlcc.errors import RequestError
from mlcc.runtime.api.structured import (
    GrammarCompiler,
    GrammarStateError,
    spec_from_response_format,
    spec_from_structured_outputs,
)

PAD = 64  # the model's vocabulary is padded past the tokenizer's, as compiled models are
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    smollm2_tokenizer_json(out)
    return out / "tokenizer.json"


@pytest.fixture(scope="module")
def gc(tokenizer_json):
    from tokenizers import Tokenizer

    n = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size()
    return GrammarCompiler(tokenizer_json, n + PAD, {EOS})


@pytest.fixture(scope="module")
def texts(gc):
    """Each token's text, to bias random walks towards finishing (whitespace and long strings are allowed
    almost everywhere, and a uniform pick would wander)."""
    tok = gc.tokenizer
    return [tok.decode_bytes([i]).decode("utf-8", "replace") if i < tok.vocab_size else ""
            for i in range(gc.vocab_size)]


def allowed(mask_row: np.ndarray) -> np.ndarray:
    return np.nonzero(np.unpackbits(mask_row.view(np.uint8), bitorder="little"))[0]


def walk(gc, texts, matcher, seed: int, prefix: str = "", max_steps: int = 600) -> str:
    """Feed `prefix`, then sample allowed tokens (seeded) until EOS; returns the text."""
    rng = np.random.default_rng(seed)
    mask = gc.allocate_mask(2)
    out: list[int] = []
    for t in gc.tokenizer.tokenize_str(prefix):
        matcher.fill_mask(mask, 1)
        assert mask[1, t >> 5] >> (t & 31) & 1, f"prefix token {t} not allowed"
        matcher.accept(t)
        out.append(t)
    for step in range(max_steps):
        matcher.fill_mask(mask, 1)
        ids = allowed(mask[1])
        assert len(ids) > 0
        if EOS in ids and (matcher.can_stop() and (step > 20 or rng.random() < 0.5) or len(ids) == 1):
            assert matcher.can_stop()
            return gc.tokenizer.decode_str(out)
        ids = ids[ids != EOS]
        visible = [i for i in ids if texts[i].strip()]
        pool = visible if visible and rng.random() < 0.9 else ids
        if step > 30:  # wrap up: prefer tokens that close strings, arrays and objects
            closing = [i for i in pool if any(c in texts[i] for c in '"]}') and len(texts[i]) <= 3]
            pool = closing if closing and rng.random() < 0.8 else pool
        t = int(rng.choice(pool))
        matcher.accept(t)
        out.append(t)
    raise AssertionError(f"no EOS after {max_steps} tokens: {gc.tokenizer.decode_str(out)[:300]!r}")


SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"enum": ["red", "green", "blue"]},
    {"const": {"k": [1, 2, "x"]}},
    {"type": "string", "minLength": 3, "maxLength": 8},
    {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    {"type": "integer", "minimum": -5, "maximum": 17},
    {"type": "number", "minimum": 0.5, "maximum": 2.5},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 4},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 0},
    {"type": "boolean"},
    {"type": "null"},
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]},
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "integer"}},
                "required": ["kind", "n"], "additionalProperties": False},
               {"type": "object", "properties": {"kind": {"const": "b"}, "s": {"type": "string", "maxLength": 5}},
                "required": ["kind", "s"], "additionalProperties": False}]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
        "required": ["name", "age"], "additionalProperties": False}}, "required": ["user"],
     "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"],
     "additionalProperties": False},
    {"type": "object", "properties": {"opt": {"type": "string", "maxLength": 5}, "req": {"type": "boolean"}},
     "required": ["req"], "additionalProperties": False},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 3}], "items": False,
     "minItems": 2},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                      "additionalProperties": False}},
     "type": "array", "items": {"$ref": "#/$defs/pt"}, "minItems": 1, "maxItems": 3},
    {"type": "string", "format": "date"},
    {"type": ["string", "null"], "maxLength": 4},
    {"type": "object", "properties": {"e": {"enum": [1, "two", None, True]}, "s": {"type": "string",
                                                                                "enum": ["α", "β"]}},
     "required": ["e", "s"], "additionalProperties": False},
    {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
    {"type": "object"},
]


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_schema_walks_validate(gc, texts, i):
    schema = SCHEMAS[i]
    grammar = gc.compile(spec_from_structured_outputs({"json": schema}))
    for seed in range(3):
        text = walk(gc, texts, gc.matcher(grammar), seed=seed * 31 + i)
        value = json.loads(text)
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())


def test_response_format(gc, texts):
    assert spec_from_response_format(None) is None
    assert spec_from_response_format({"type": "text"}) is None
    obj = gc.compile(spec_from_response_format({"type": "json_object"}))
    assert isinstance(json.loads(walk(gc, texts, gc.matcher(obj), seed=1)), dict)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    spec = spec_from_response_format({"type": "json_schema", "json_schema": {"name": "a", "schema": schema,
                                                                             "strict": True}})
    assert json.loads(walk(gc, texts, gc.matcher(gc.compile(spec)), seed=2)) in ({"answer": "yes"},
                                                                                   {"answer": "no"})
    assert gc.compile(spec) is gc.compile(spec)  # cached


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
                                     r"\d{1,2}:\d\d (AM|PM)"])
def test_regex(gc, texts, pattern):
    g = gc.compile(spec_from_structured_outputs({"regex": pattern}))
    for seed in range(3):
        text = walk(gc, texts, gc.matcher(g), seed=seed)
        assert re.fullmatch(pattern, text), text


def test_choice(gc, texts):
    choices = ["Paris", "London", "New York", "naïve ☃"]
    g = gc.compile(spec_from_structured_outputs({"choice": choices}))
    seen = {walk(gc, texts, gc.matcher(g), seed=s) for s in range(12)}
    assert seen <= set(choices) and len(seen) >= 2


def test_lark_and_gbnf(gc, texts):
    lark = 'start: "The answer is " NUM "."\nNUM: /[1-9][0-9]{0,2}/'
    gbnf = 'root ::= "The answer is " num "."\nnum ::= [1-9] [0-9]? [0-9]?'
    for grammar in (lark, gbnf):
        g = gc.compile(spec_from_structured_outputs({"grammar": grammar}))
        for seed in range(3):
            assert re.fullmatch(r"The answer is [1-9][0-9]{0,2}\.", walk(gc, texts, gc.matcher(g), seed=seed))


def test_mask_layout_padding_and_eos(gc, texts):
    g = gc.compile(spec_from_structured_outputs({"choice": ["ok"]}))
    m = gc.matcher(g)
    mask = gc.allocate_mask(3)
    assert mask.shape == (3, (gc.vocab_size + 31) // 32) and mask.dtype == np.int32
    m.fill_mask(mask, 2)
    assert (mask[0] == -1).all() and (mask[1] == -1).all()  # other rows untouched
    free = gc.compile(spec_from_structured_outputs({"grammar": 'start: /(.|\\n)*/'}))
    fm = gc.matcher(free)
    fm.fill_mask(mask, 0)
    ids = allowed(mask[0])
    assert ids.max() < gc.tokenizer.vocab_size - PAD  # the padded rows past the tokenizer are never allowed
    assert EOS in ids and 0 not in ids  # EOS allowed when the grammar may end; other special tokens never
    for t in gc.tokenizer.tokenize_str("ok"):
        m.accept(t)
    assert m.is_done() and m.can_stop()
    m.fill_mask(mask, 1)
    assert allowed(mask[1]).tolist() == [EOS]  # done: only EOS, so the choice ends with "stop"
    m.accept(EOS)
    with pytest.raises(GrammarStateError):
        gc.matcher(g).accept(gc.tokenizer.tokenize_str("no")[0])


def test_more_eos_ids_and_vocab_smaller_than_tokenizer(tokenizer_json):
    from tokenizers import Tokenizer

    n = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size()
    gc2 = GrammarCompiler(tokenizer_json, n - 8, {EOS, 0})
    m = gc2.matcher(gc2.compile(spec_from_structured_outputs({"choice": ["a"]})))
    for t in gc2.tokenizer.tokenize_str("a"):
        m.accept(t)
    mask = gc2.allocate_mask(1)
    m.fill_mask(mask, 0)
    assert mask.shape[1] == (n - 8 + 31) // 32 and allowed(mask[0]).tolist() == [0, EOS]


@pytest.mark.parametrize(("field", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(("}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "#/$defs/missing"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}},
     "response_format.json_schema.extra"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", 3]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "root ::= ( \"a\""}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": {"type": "string", "minLength": 5, "maxLength": 2}}},
     "structured_outputs.json"),
])
def test_errors_name_the_field(gc, field, param):
    with pytest.raises(RequestError) as e:
        if "response_format" in field:
            spec = spec_from_response_format(field["response_format"])
        else:
            spec = spec_from_structured_outputs(field["structured_outputs"])
        gc.compile(spec)
    assert e.value.param == param, (e.value.param, str(e.value))
    assert str(e.value)


@pytest.mark.parametrize("so", [{"regex": "(a{1000}){1000}"}, {"regex": "(a|b)*a(a|b){40}"},
                                {"json": {"type": "string", "pattern": "^(a{1000}){1000}$"}}])
def test_pathological_grammar_never_stalls(gc, so):
    """llguidance builds lexer states lazily; under the compiler's limits neither the compile nor a step takes
    long, and a grammar that runs out of lexer states ends the choice with EOS instead of failing the batch."""
    t = time.perf_counter()
    m = gc.matcher(gc.compile(spec_from_structured_outputs(so)))
    assert time.perf_counter() - t < 5
    mask = gc.allocate_mask(1)
    text = ('"' if "json" in so else "") + "ab" * 60
    for tok in gc.tokenizer.tokenize_str(text):
        t = time.perf_counter()
        m.fill_mask(mask, 0)
        if m.error:
            break
        if not mask[0, tok >> 5] >> (tok & 31) & 1:
            break  # the text left the language: fine, the walk only probes step costs
        m.accept(tok)
        assert time.perf_counter() - t < 2
    if "json" in so:  # this one runs out of lexer states within a few tokens
        assert m.error
    if m.error:
        m.fill_mask(mask, 0)
        assert allowed(mask[0]).tolist() == [EOS] and m.is_done()


def test_timings(gc, tokenizer_json, capsys):
    """Reports the costs the engine pays (run with -s to see them)."""
    t0 = time.perf_counter()
    GrammarCompiler(tokenizer_json, gc.vocab_size, {EOS})
    t_tok = time.perf_counter() - t0
    props = {f"p{i}": [{"type": "integer", "minimum": 0, "maximum": 1000}, {"type": "string", "maxLength": 20},
                       {"enum": ["a", "b", "c"]}, {"type": "boolean"}, {"type": "array", "items": {"type": "number"},
                                                                         "maxItems": 3}][i % 5] for i in range(50)}
    schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    t0 = time.perf_counter()
    g = gc.compile(spec_from_structured_outputs({"json": schema}))
    t_compile = time.perf_counter() - t0
    m = gc.matcher(g)
    mask = gc.allocate_mask(1)
    t0 = time.perf_counter()
    m.fill_mask(mask, 0)
    t_first = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    steps = []
    while not m.is_done() and len(steps) < 3000:
        t0 = time.perf_counter()
        m.fill_mask(mask, 0)
        steps.append(time.perf_counter() - t0)
        ids = allowed(mask[0])
        if m.can_stop() and EOS in ids:
            break
        ids = ids[ids != EOS]
        t0 = time.perf_counter()
        m.accept(int(rng.choice(ids)))
        steps[-1] += time.perf_counter() - t0
    steps_ms = np.array(steps) * 1e3
    with capsys.disabled():
        print(f"\n[structured timings, vocab {gc.vocab_size}] tokenizer {t_tok * 1e3:.0f} ms; 50-property schema "
              f"compile {t_compile * 1e3:.1f} ms; first mask {t_first * 1e3:.3f} ms; per token (mask + accept) "
              f"mean {steps_ms.mean():.3f} ms, p50 {np.median(steps_ms):.3f} ms, p99 "
              f"{np.percentile(steps_ms, 99):.3f} ms over {len(steps)} tokens")
    assert np.median(steps_ms) < 1.0
