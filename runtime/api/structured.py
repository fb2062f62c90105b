"""Grammar-constrained decoding on the host: request fields → GrammarSpec → compiled Grammar → a Matcher per choice.

Everything goes through llguidance (JSON schema, regex, choice, Lark, GBNF), built from the artifacts folder's
tokenizer.json with `LLTokenizer` (never `llguidance.hf`, which imports transformers). A Matcher writes the allowed
next tokens as a bitmask in llguidance's layout (bit v % 32 of int32 word v // 32) into one row of the engine's
preallocated `[batch, ceil(V / 32)]` array; once the grammar is complete only the EOS ids are allowed, so the
choice ends with finish_reason "stop".

A bad grammar is a RequestError naming the request field. llguidance builds lexer states lazily, so a pathological
grammar (say a regex `(a{1000}){1000}`) would stall the first mask of a decode step instead of the compile: compile()
therefore computes the first mask itself, under LLParserLimits tight enough that such a grammar is an error within
a few hundred milliseconds rather than a multi-second stall.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
import numpy as np

from mlcc.errors import MlccError, RequestError

# JSON whitespace between tokens: flexible (models write `{"a": 1}` and pretty-printed JSON) but bounded, so a
# model cannot loop on whitespace forever inside a constrained object.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,24}",
                                "lenient": False}
# Fewer lexer states and less lexer fuel than llguidance's defaults (250k states ≈ 0.5 GB): a grammar that needs
# more is refused at compile time; ordinary schemas use a few hundred states.
_LIMITS = {"initial_lexer_fuel": 300_000, "step_lexer_fuel": 200_000, "max_lexer_states": 50_000,
           "max_grammar_size": 200_000}
_CACHE_SIZE = 256
# Brackets a tag's index in a Lark text (GrammarSpec.tags); a NUL never survives json.dumps, so it cannot come from
# a schema.
TAG_MARK = "\x00"
GRAMMAR_KINDS = ("json_schema", "regex", "choice", "lark")


class GrammarStateError(MlccError, RuntimeError):
    """The engine fed a matcher a token its mask did not allow (a sampling bug, not a user error)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain a choice to, independent of the tokenizer (hashable: the compile cache's key).

    kind: one of GRAMMAR_KINDS; text: the schema as JSON text, the regex, the choices as a JSON list, or a Lark
    grammar (GBNF is converted when the spec is built); param: the request field an error names.
    tags: the tool-call tags (`<tool_call>`, `</tool_call>`, `[TOOL_CALLS]`) the Lark text writes as tag_ref(i).
    Each becomes its token where it is one special token of the engine's tokenizer (a model writes that token, and
    llguidance never matches a special token against text, `</tool_call>` spelled out included), else its text.
    trigger / special_text: the lazy grammar's opening tag, and the grammar to use where it is a special token
    (free text then ends at that token instead of at a lazy lexeme); otherwise `text`.
    parts: (param, schema JSON) pairs checked one by one when the whole grammar fails, so the error names the tool.
    lazy: free text is allowed until the trigger appears (tool_choice "auto").
    """

    kind: str
    text: str
    param: str
    trigger: str | None = None
    special_text: str | None = None
    parts: tuple[tuple[str, str], ...] = ()
    lazy: bool = False
    tags: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        h = hashlib.sha256()
        for v in (self.kind, self.text, self.trigger or "", self.special_text or "", *self.tags):
            h.update(v.encode("utf-8", "surrogatepass"))
            h.update(b"\x01")
        return h.hexdigest()


def tag_ref(i: int) -> str:
    """Where GrammarSpec.tags[i] stands in a Lark text."""
    return f"{TAG_MARK}{i}{TAG_MARK}"


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise RequestError(f"{param} is not valid JSON ({e}); pass a JSON Schema object", param=param) from e
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise RequestError(f"{param} must be a JSON Schema object, got {type(schema).__name__}", param=param)
    # the properties' order is kept: the output writes them in the schema's order, as OpenAI's does
    return json.dumps(schema, ensure_ascii=True)


def json_schema_spec(schema: Any, param: str) -> GrammarSpec:
    return GrammarSpec("json_schema", _schema_text(schema, param), param)


def spec_from_response_format(response_format: dict | None) -> GrammarSpec | None:
    """OpenAI's `response_format`: {"type": "text"} → None; "json_object" → any JSON object; "json_schema" →
    json_schema.schema (a missing schema means any JSON object)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise RequestError("response_format must be an object like {\"type\": \"json_object\"}",
                           param="response_format")
    kind = response_format.get("type")
    extra = set(response_format) - {"type", "json_schema"}
    if extra:
        raise RequestError(f"response_format has unknown field '{min(extra)}'; it takes 'type' and "
                           "'json_schema'", param=f"response_format.{min(extra)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_spec({"type": "object"}, "response_format")
    if kind == "json_schema":
        js = response_format.get("json_schema")
        if not isinstance(js, dict):
            raise RequestError("response_format.json_schema must be an object with 'name' and 'schema'",
                               param="response_format.json_schema")
        extra = set(js) - {"name", "schema", "strict", "description"}
        if extra:
            name = min(extra)
            raise RequestError(f"response_format.json_schema has unknown field '{name}'; it takes name, schema, "
                               "strict and description", param=f"response_format.json_schema.{name}")
        schema = js.get("schema", {"type": "object"})
        return json_schema_spec(schema, "response_format.json_schema.schema")
    raise RequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema', not {kind!r}",
                       param="response_format.type")


_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def spec_from_structured_outputs(structured_outputs: dict) -> GrammarSpec:
    """vLLM's `structured_outputs`: exactly one of {"json": schema}, {"regex": str}, {"choice": [str, ...]},
    {"grammar": Lark or GBNF text (GBNF is recognised by `::=`)}, {"json_object": true}."""
    p = "structured_outputs"
    if not isinstance(structured_outputs, dict):
        raise RequestError(f"{p} must be an object with one of the keys {', '.join(_STRUCTURED_KEYS)}", param=p)
    unknown = [k for k in structured_outputs if k not in _STRUCTURED_KEYS]
    if unknown:
        raise RequestError(f"{p} has unknown key '{unknown[0]}'; use one of {', '.join(_STRUCTURED_KEYS)}",
                           param=f"{p}.{unknown[0]}")
    given = [k for k in _STRUCTURED_KEYS if structured_outputs.get(k) is not None]
    if len(given) != 1:
        raise RequestError(f"{p} needs exactly one of {', '.join(_STRUCTURED_KEYS)}; got "
                           f"{', '.join(given) or 'none'}", param=p)
    key = given[0]
    value, param = structured_outputs[key], f"{p}.{key}"
    if key == "json":
        return json_schema_spec(value, param)
    if key == "json_object":
        if value is not True:
            raise RequestError(f"{param} must be true", param=param)
        return json_schema_spec({"type": "object"}, param)
    if key == "regex":
        if not isinstance(value, str) or not value:
            raise RequestError(f"{param} must be a non-empty regular expression string", param=param)
        return GrammarSpec("regex", value, param)
    if key == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise RequestError(f"{param} must be a non-empty list of non-empty strings", param=param)
        return GrammarSpec("choice", json.dumps(value, ensure_ascii=True), param)
    if not isinstance(value, str) or not value.strip():
        raise RequestError(f"{param} must be a Lark or GBNF grammar string", param=param)
    return GrammarSpec("lark", grammar_to_lark(value, param), param)


def grammar_to_lark(text: str, param: str) -> str:
    """Lark text as is; GBNF (llama.cpp's `rule ::= ...`) converted with llguidance's own converter."""
    if "::=" not in text:
        return text
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(text)
    except Exception as e:  # the converter raises plain Exceptions with a line/column in the message
        raise RequestError(f"{param}: cannot read the GBNF grammar: {e}", param=param) from e


def _llg_grammar(kind: str, text: str) -> str:
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(text)
    raise ValueError(f"unknown grammar kind {kind!r}")


def _short(err: str) -> str:
    # llguidance appends parser state dumps after "<state>"; the first lines say what is wrong
    return err.split("\n<state>", 1)[0].strip()[:600]


class Grammar:
    """A compiled grammar: a matcher in its start state (first mask already computed), copied per request."""

    __slots__ = ("_template", "spec")

    def __init__(self, spec: GrammarSpec, template: llguidance.LLMatcher):
        self.spec = spec
        self._template = template


class Matcher:
    """One choice's grammar state. Not thread-safe; one per request and per choice for n > 1."""

    __slots__ = ("_eos", "_m", "_scratch", "_words", "error")

    def __init__(self, m: llguidance.LLMatcher, words: int, scratch_words: int, eos_ids: tuple[int, ...]):
        self._m = m
        self._words = words
        self._scratch = np.zeros((1, scratch_words), np.int32) if scratch_words > words else None
        self._eos = eos_ids
        self.error: str | None = None  # set when llguidance hit a limit mid-generation: only EOS is allowed then

    def fill_mask(self, out: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into out[row] (int32, C-contiguous, ceil(vocab_size / 32) words)."""
        v = out[row]
        if self._scratch is None:
            self._m.unsafe_compute_mask_ptr(v.ctypes.data, v.nbytes)
        else:  # the tokenizer knows more ids than the model's vocabulary: those can never be sampled
            s = self._scratch[0]
            self._m.unsafe_compute_mask_ptr(s.ctypes.data, s.nbytes)
            v[:] = s[: self._words]
        if self._m.is_error():
            self.error = _short(self._m.get_error())
            v[:] = 0
            bits = v.view(np.uint32)
            for t in self._eos:
                bits[t >> 5] |= np.uint32(1 << (t & 31))

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token; raises GrammarStateError if the mask did not allow it."""
        if self.error is not None:
            return  # a limit was hit: the EOS-only mask ends the choice
        if not self._m.consume_token(int(token_id)):
            err = _short(self._m.get_error())
            if not err.startswith("Parser Error: token"):
                # a lexer/parser limit (the grammar, not the token): the next mask allows only EOS
                self.error = err
                return
            raise GrammarStateError(f"token {token_id} is not allowed by the grammar: {err}")

    def is_done(self) -> bool:
        """The grammar is complete: only EOS may follow."""
        return self.error is not None or self._m.is_stopped()

    def can_stop(self) -> bool:
        """EOS is allowed now (the grammar is satisfied, though it might also continue, like `12` → `123`)."""
        return self.error is not None or self._m.is_accepting()

    def forced_text(self) -> bytes:
        """Bytes the grammar forces next (e.g. a tool call's `{"name": "f", "arguments": `); for speculative
        fast-forwarding, optional."""
        return self._m.compute_ff_bytes()


class GrammarCompiler:
    """One per Engine: the tokenizer for masks, and an LRU of compiled grammars keyed by the spec."""

    def __init__(self, tokenizer_json: Path | str, vocab_size: int, eos_ids: set[int] | list[int] | tuple[int, ...]):
        eos = tuple(sorted({int(e) for e in eos_ids}))
        if not eos:
            raise ValueError("GrammarCompiler needs at least one EOS id: a finished grammar allows only EOS")
        try:
            self.tokenizer = llguidance.LLTokenizer(str(tokenizer_json), n_vocab=int(vocab_size), eos_token=list(eos))
        except ValueError:  # the tokenizer has ids past the model's rows: masks are built wide, then cut
            self.tokenizer = llguidance.LLTokenizer(str(tokenizer_json), eos_token=list(eos))
        n_vocab = self.tokenizer.vocab_size
        if any(e >= min(n_vocab, int(vocab_size)) for e in eos):
            raise ValueError(f"EOS ids {eos} are outside the vocabulary of {vocab_size} tokens")
        self.vocab_size = int(vocab_size)
        self.mask_words = (self.vocab_size + 31) // 32
        self._scratch_words = (n_vocab + 31) // 32
        self.eos_ids = eos
        self._limits = llguidance.LLParserLimits(**_LIMITS)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def allocate_mask(self, batch: int) -> np.ndarray:
        """An int32 [batch, ceil(vocab_size / 32)] mask array, all tokens allowed."""
        return np.full((batch, self.mask_words), -1, dtype=np.int32)

    def special_token_id(self, text: str) -> int | None:
        """The id of `text` if it is a single special token of this tokenizer (tags like `<tool_call>`)."""
        ids = self.tokenizer.tokenize_str(text, parse_special=True)
        if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]):
            return ids[0]
        return None

    def compile(self, spec: GrammarSpec) -> Grammar:
        key = spec.key
        with self._lock:
            g = self._cache.get(key)
            if g is not None:
                self._cache.move_to_end(key)
                return g
        g = self._build(spec)
        with self._lock:
            self._cache[key] = g
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return g

    def matcher(self, grammar: Grammar) -> Matcher:
        return Matcher(grammar._template.deep_copy(), self.mask_words, self._scratch_words, self.eos_ids)

    def _build(self, spec: GrammarSpec) -> Grammar:
        text = spec.text
        if spec.trigger is not None and spec.special_text is not None and self.special_token_id(spec.trigger) is not None:
            text = spec.special_text
        for i, tag in enumerate(spec.tags):
            tid = self.special_token_id(tag)
            text = text.replace(tag_ref(i), f"<[{tid}]>" if tid is not None else json.dumps(tag, ensure_ascii=True))
        try:
            grammar = _llg_grammar(spec.kind, text)
        except ValueError as e:
            raise RequestError(f"{spec.param}: {e}", param=spec.param) from e
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        if not m.is_error():
            # the first mask builds the start states; a grammar past the limits fails here, not mid-decode
            scratch = np.zeros((1, self._scratch_words), np.int32)
            m.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        if m.is_error():
            raise self._error(spec, _short(m.get_error()))
        return Grammar(spec, m)

    def _error(self, spec: GrammarSpec, err: str) -> RequestError:
        param = spec.param
        for part_param, schema in spec.parts:
            g = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
            part_err = llguidance.LLMatcher.validate_grammar(g, None, limits=self._limits)
            if part_err:
                param, err = part_param, _short(part_err)
                break
        what = {"json_schema": "JSON schema", "regex": "regular expression", "choice": "choice list",
                "lark": "grammar"}[spec.kind]
        if "too many" in err or "limit" in err.lower() or "fuel" in err:
            hint = "it is too large or complex to enforce; simplify it (fewer alternatives, smaller repeat counts)"
        elif "Unimplemented" in err:
            hint = "these JSON Schema keywords are not supported; remove them"
        else:
            hint = "fix it"
        return RequestError(f"{param}: invalid or unsupported {what}: {err} ({hint})", param=param,
                            code="invalid_request_error")
