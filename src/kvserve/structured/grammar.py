"""From a request's StructuredOutputsParams to one llguidance grammar text, checked.

A JSON schema is checked before it is compiled: against its meta-schema (with `jsonschema`, when
installed), so an invalid schema is a 400 naming the failing path, and for keywords llguidance
would ignore or refuse, so an unsupported keyword is a 400 naming it and where it is. Grammars
are compiled (llguidance validates them against the tokenizer) once per distinct text and the
verdict cached; the server does it on a worker thread with a time limit (`compile_async`).

What a compile may cost is bounded before and during it, so a thread past the time limit does
not go on for long: a grammar text longer than `MAX_GRAMMAR_CHARS` is refused before it reaches
llguidance (a `choice` of 80,000 options costs ~35 s to build, growing with the square of the
count), and every matcher is built with `parser_limits()`: llguidance's own fuel for the lexer's
first construction and a cap on its states (`((x{100}){100}){100}` costs 2.7 s with the
defaults, 0.3 s within these), so the work is counted by llguidance rather than by a clock.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from typing import Any

from kvserve.errors import InvalidRequest
from kvserve.sampling_params import StructuredOutputsParams

# JSON output the way json.dumps writes it (what models saw most), no free whitespace: a small
# model given "any whitespace" may spend its whole budget on newlines.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
COMPILE_TIMEOUT_S = 5.0
MAX_GRAMMAR_CHARS = 1 << 18      # 256 KiB of grammar text (what llguidance compiles in ~1 s here)
INITIAL_LEXER_FUEL = 200_000     # llguidance's default is 1,000,000
MAX_LEXER_STATES = 50_000        # 1-2 kB each; llguidance's default is 250,000
_UNSUPPORTED = frozenset({
    "not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains", "propertyNames",
    "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems",
    "contentEncoding", "contentMediaType", "contentSchema", "$dynamicRef", "$recursiveRef"})
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "additionalItems")


def _import_llguidance():
    try:
        import llguidance
    except ImportError:
        raise InvalidRequest("structured output needs the llguidance package: pip install 'kvserve[structured]'",
                             param="response_format") from None
    return llguidance


def load_schema(schema: dict | str, param: str) -> dict:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidRequest(f"{param} is not valid JSON ({e}).", param=param) from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param} must be a JSON schema object.", param=param)
    return schema


def check_json_schema(schema: dict, param: str = "json_schema") -> None:
    """Raise InvalidRequest naming the failing path (meta-schema) or the unsupported keyword."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            cls.check_schema(schema)
        except jsonschema.SchemaError as e:
            where = param + e.json_path[1:]          # "$.properties.a.type" -> param.properties.a.type
            raise InvalidRequest(f"Invalid JSON schema at {where}: {e.message}.", param=where) from None
    _walk(schema, "", param)


def _walk(node: Any, path: str, param: str) -> None:
    if not isinstance(node, dict):
        return
    for key in node:
        if key in _UNSUPPORTED:
            raise InvalidRequest(f"JSON schema keyword {key!r} (at {param}{path}) is not supported for "
                                 "structured output; remove it or express it with enum/anyOf/pattern.",
                                 param=f"{param}{path}.{key}")
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _walk(sub, f"{path}.{key}.{name}", param)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                _walk(sub, f"{path}.{key}[{i}]", param)
    for key in _SUBSCHEMAS:
        _walk(node.get(key), f"{path}.{key}", param)


SAFE_INT = 2**53 - 1      # integers JSON round-trips exactly (JavaScript's safe range)
FORMAT_MAX_LENGTH = 254   # the longest email address / host name


def tighten(node: Any) -> Any:
    """A copy of the schema with what it leaves unbounded bounded, so a small model cannot loop
    on digits: integers within +-(2^53-1), format strings (email, time, ...) at most 254 chars.
    Every output of the tightened schema is valid under the original."""
    if isinstance(node, list):
        return [tighten(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: (tighten(v) if k not in ("enum", "const", "required", "default", "examples") else v)
           for k, v in node.items()}
    types = out.get("type")
    types = types if isinstance(types, list) else [types]
    if "integer" in types:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INT
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INT
    if "string" in types and "format" in out and "maxLength" not in out:
        out["maxLength"] = FORMAT_MAX_LENGTH
    return out


def build_grammar(so: StructuredOutputsParams, param: str = "structured_outputs") -> str:
    """The llguidance grammar text (llguidance's JSON form) for one spec; checks JSON schemas."""
    llg = _import_llguidance()
    kind = so.kind
    if kind == "json":
        schema = load_schema(so.json, param)
        check_json_schema(schema, param)
        return llg.LLMatcher.grammar_from_json_schema(tighten(schema), defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    try:
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(so.regex)
        if kind == "choice":
            return llg.grammar_from("choice", json.dumps(list(so.choice)))
        return llg.grammar_from("grammar", so.grammar)     # Lark, or GBNF (converted)
    except ValueError as e:     # a GBNF text llguidance cannot convert, say
        raise InvalidRequest(f"The {kind} for {param} does not compile: {str(e)[:300]}", param=param) from None


def parser_limits():
    """The llguidance limits every matcher is built with (module docstring)."""
    return _import_llguidance().LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL,
                                                max_lexer_states=MAX_LEXER_STATES)


def new_matcher(lltokenizer, grammar: str, param: str = "structured_outputs"):
    """An llguidance matcher for `grammar`, within the size cap and `parser_limits()`; check
    `is_error()` on it. A grammar over the size cap is an InvalidRequest without compiling."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"The grammar for {param} is {len(grammar)} characters long once built; at most "
                             f"{MAX_GRAMMAR_CHARS} are compiled. Use fewer options or a smaller schema.",
                             param=param)
    return _import_llguidance().LLMatcher(lltokenizer, grammar, log_level=0, limits=parser_limits())


class GrammarCompiler:
    """Checks grammar texts against one tokenizer, once each (an LRU of verdicts); thread-safe.

    `lltokenizer()` is the llguidance view of the tokenizer (its whole vocabulary, special tokens
    included, sized to the model's logits); the core's backend shares it."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 512):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltok = None
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[str, str] = OrderedDict()
        self._grammars: OrderedDict[str, str] = OrderedDict()    # spec key -> checked grammar text
        self._templates: OrderedDict[str, Any] = OrderedDict()   # grammar text -> compiled LLMatcher
        self.cache_size = cache_size

    def lltokenizer(self):
        with self._lock:
            if self._lltok is None:
                llg = _import_llguidance()
                self._lltok = llg.LLTokenizer(self.tokenizer.hf.to_str(), n_vocab=self.vocab_size,
                                              eos_token=list(self.tokenizer.eos_token_ids))
            return self._lltok

    def check(self, grammar: str, param: str = "structured_outputs") -> None:
        """Compile `grammar` against the tokenizer (or find the verdict); InvalidRequest if it fails.
        The compiled matcher is kept as a template (its first mask computed, so copies start warm):
        an engine core in this process takes it instead of compiling the grammar again."""
        with self._lock:
            err = self._verdicts.get(grammar)
            if err is not None:
                self._verdicts.move_to_end(grammar)
        if err is None:
            m = new_matcher(self.lltokenizer(), grammar, param)
            err = m.get_error() if m.is_error() else ""
            if not err:
                import torch
                buf = torch.empty((self.vocab_size + 31) // 32, dtype=torch.int32)
                m.unsafe_compute_mask_ptr(buf.data_ptr(), buf.numel() * 4)
            with self._lock:
                self._verdicts[grammar] = err
                if not err:
                    self._templates[grammar] = m
                for cache in (self._verdicts, self._templates):
                    while len(cache) > self.cache_size:
                        cache.popitem(last=False)
        if err:
            raise InvalidRequest(f"The grammar for {param} does not compile: {err}", param=param)

    def template(self, grammar: str):
        """The compiled matcher for a grammar this compiler checked (None if it was not, or evicted)."""
        with self._lock:
            return self._templates.get(grammar)

    def warm_up(self) -> None:
        """Pay the first request's one-time costs now (imports, the llguidance tokenizer, the
        meta-schema validator): a server calls it on a background thread at start."""
        self.prepare(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}}))

    def prepare(self, so: StructuredOutputsParams, param: str = "structured_outputs") -> str:
        """The checked grammar text for a spec (the spec -> grammar step is cached too)."""
        key = json.dumps([so.kind, getattr(so, so.kind)], sort_keys=True)
        with self._lock:
            grammar = self._grammars.get(key)
        if grammar is None:
            grammar = build_grammar(so, param)
            self.check(grammar, param)
            with self._lock:
                self._grammars[key] = grammar
                while len(self._grammars) > self.cache_size:
                    self._grammars.popitem(last=False)
        return grammar

    async def prepare_async(self, so: StructuredOutputsParams, param: str = "structured_outputs",
                            timeout: float = COMPILE_TIMEOUT_S) -> str:
        """`prepare` on a worker thread: the event loop and the other requests never wait for it; a
        grammar that takes longer than `timeout` is refused (400)."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.prepare, so, param), timeout)
        except TimeoutError:
            raise InvalidRequest(f"The grammar for {param} took longer than {timeout:g}s to compile; "
                                 "simplify it.", param=param) from None


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def compiler_for(tokenizer, vocab_size: int) -> GrammarCompiler:
    """One GrammarCompiler per tokenizer object (the client and an in-process core share it)."""
    comp = getattr(tokenizer, "_kvserve_grammar_compiler", None)
    if comp is None or comp.vocab_size != vocab_size:
        comp = GrammarCompiler(tokenizer, vocab_size)
        tokenizer._kvserve_grammar_compiler = comp
    return comp
