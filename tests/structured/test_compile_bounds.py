"""A grammar compile is bounded in work before and while it runs: an oversize grammar never
reaches llguidance (400 naming the field), and every matcher is built within llguidance's fuel
and state limits, so a compile past the server's time limit leaves no long-running thread."""

from __future__ import annotations

import gguf
import pytest

from kvserve.errors import InvalidRequest
from kvserve.model.registry import resolve
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured import grammar as grammar_mod
from kvserve.structured.backend import GrammarBackend
from kvserve.tokenizer import Tokenizer

llg = pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def compiler():
    tok = Tokenizer.from_gguf(gguf.GGUFReader(resolve(None).path))
    return grammar_mod.GrammarCompiler(tok, 49152)


@pytest.fixture
def built(monkeypatch):
    """Every LLMatcher built, with the limits it was given."""
    seen: list = []
    real = llg.LLMatcher

    class Spy:
        def __call__(self, tok, grammar, **kw):
            seen.append(kw.get("limits"))
            return real(tok, grammar, **kw)

        def __getattr__(self, name):      # grammar_from_regex and the other static helpers
            return getattr(real, name)

    monkeypatch.setattr(llg, "LLMatcher", Spy())
    return seen


def test_an_oversize_choice_is_a_400_without_compiling(compiler, built):
    """80,000 options (a ~1 MB grammar) cost llguidance ~35 s before it gives up on them."""
    so = StructuredOutputsParams(choice=[f"opt{i}" for i in range(80_000)])
    with pytest.raises(InvalidRequest) as e:
        compiler.prepare(so, "response_format")
    assert e.value.param == "response_format" and "characters" in str(e.value)
    assert built == []


def test_every_matcher_is_built_within_llguidances_limits(compiler, built):
    """A regex whose lexer costs llguidance's whole default fuel (2.7 s here) is built with a
    fifth of it, by the client's check and by the core's compile alike."""
    so = StructuredOutputsParams(regex="((x{100}){100}){100}")
    grammar = compiler.prepare(so)
    assert len(built) == 1
    limits = built[0]
    assert limits is not None and limits.initial_lexer_fuel == grammar_mod.INITIAL_LEXER_FUEL < 1_000_000
    assert limits.max_lexer_states == grammar_mod.MAX_LEXER_STATES < 250_000
    backend = GrammarBackend(compiler)
    try:
        backend._compile(grammar)      # the core's compile: the same limits
        assert len(built) == 2 and built[1].initial_lexer_fuel == grammar_mod.INITIAL_LEXER_FUEL
        m = backend._compile(compiler.prepare(StructuredOutputsParams(regex="x{3}"))).deep_copy()
        x = compiler.tokenizer.encode("x", add_special_tokens=False)
        assert m.consume_tokens(x * 3) and not m.is_error() and m.is_accepting()
    finally:
        backend.shutdown()


def test_honest_grammars_compile_as_before(compiler):
    for so in (StructuredOutputsParams(choice=["yes", "no", "maybe"]),
               StructuredOutputsParams(regex=r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}"),
               StructuredOutputsParams(choice=[f"option{i}" for i in range(5000)]),
               StructuredOutputsParams(json={"type": "object", "properties": {
                   f"p{i}": {"type": "string", "pattern": "[a-z]{1,20}@[a-z]+"} for i in range(200)}})):
        assert compiler.prepare(so)
