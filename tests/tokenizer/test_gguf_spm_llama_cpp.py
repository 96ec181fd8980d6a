"""kvserve against llama.cpp (llama-cpp-python) on the same GGUF files: SentencePiece tokenization
token for token, for every model kind (BPE and unigram models, with and without the space
prefix, Phi-3's whitespace stripping after special tokens), and greedy continuations of a
random-weight llama file with that vocabulary (equal, or differing only after a near tie)."""

from __future__ import annotations

import pytest
from spm_corpus import KINDS, TEST_TEXTS

pytestmark = pytest.mark.slow

NEAR_TIE = 0.05   # nats between llama.cpp's top two tokens where a differing greedy pick is allowed


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        pytest.skip("llama-cpp-python is not installed: the comparison with llama.cpp needs it")
    return llama_cpp


def _vocab_only(path: str):
    return _llama_cpp().Llama(model_path=path, vocab_only=True, verbose=False)


def _tok(path: str):
    from kvserve.model.gguf_loader import open_gguf
    from kvserve.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_gguf(open_gguf(path))


def _exact(gguf_path: str):
    """llama.cpp's SPM algorithm in Python (spm_exact.py), built whether or not the file needs it."""
    from kvserve.model.gguf_loader import open_gguf
    from kvserve.tokenizer import gguf_vocab, spm_exact
    from kvserve.tokenizer.tokenizer import gguf_field

    reader = open_gguf(gguf_path)
    real = spm_exact.needs_exact
    spm_exact.needs_exact = lambda *a: True
    try:
        return gguf_vocab.exact_spm_encoder(lambda k, d=None: gguf_field(reader, k, d))
    finally:
        spm_exact.needs_exact = real


def _compare(gguf_path: str, texts=TEST_TEXTS) -> int:
    """Asserts equal ids on every text (with and without BOS), from the tokenizer kvserve builds
    and from the Python transcription of llama.cpp's encoder; returns the tokens compared."""
    ll, tok, exact = _vocab_only(gguf_path), _tok(gguf_path), _exact(gguf_path)
    n = 0
    for text in texts:
        assert exact.encode(text) == ll.tokenize(text.encode(), add_bos=False, special=True), text
        for add_bos in (False, True):
            want = ll.tokenize(text.encode(), add_bos=add_bos, special=True)
            assert tok.encode(text, add_special_tokens=add_bos) == want, (add_bos, text)
            n += len(want)
    return n


@pytest.mark.parametrize("kind", [k[0] for k in KINDS])
def test_tokenization_equals_llama_cpp(spm_files, kind):
    assert _compare(spm_files[kind][1]) > 1000


@pytest.mark.parametrize("variant", ["gemma", "phi-3"])
def test_tokenization_variants_equal_llama_cpp(spm_files, tmp_path, variant):
    """Gemma's files: no space prefix. Phi-3's: llama.cpp strips whitespace after special tokens
    (by the model's name)."""
    from spm_corpus import PHI3_CONTROL, train_spm

    from kvserve.bench.gguf_vocab import write_vocab_only

    model = spm_files["bpe-1000"][0]
    if variant == "gemma":
        path = write_vocab_only(tmp_path / "g.gguf", model, name="gemma-test", add_space_prefix=False)
    else:
        model = train_spm(tmp_path / "phi3", "bpe", 1000, True, control=tuple(PHI3_CONTROL))
        path = write_vocab_only(tmp_path / "p.gguf", model, name="Phi-3-mini-test")
    assert _compare(str(path)) > 1000


def test_detokenize_pieces_equal_llama_cpp(spm_files):
    """Decoding agrees with llama.cpp's pieces (U+2581 as spaces, byte-fallback tokens as their
    bytes joined into UTF-8). llama-cpp-python's detokenize joins the pieces as they are; llama.cpp's
    llama_detokenize, and we, drop the space the prefix put before the first piece."""
    for kind, prefix in (("bpe-1000", True), ("unigram-1500-noprefix", False)):
        path = spm_files[kind][1]
        ll, tok = _vocab_only(path), _tok(path)
        for text in TEST_TEXTS:
            if "<" in text:
                continue
            ids = tok.encode(text, add_special_tokens=False)
            pieces = ll.detokenize(ids)
            if prefix and ids:
                assert pieces.startswith(b" ")
                pieces = pieces[1:]
            assert pieces.decode("utf-8", "replace") == tok.decode(ids) == text, (kind, text)


def test_greedy_continuation_equals_llama_cpp(spm_files, tmp_path):
    """The random-weight llama file with an SPM vocabulary: kvserve's greedy tokens equal
    llama.cpp's on the same file, or differ only after a near tie in llama.cpp's logits."""
    import numpy as np

    from kvserve import LLM, SamplingParams
    from kvserve.bench.gguf_random import write

    llama_cpp = _llama_cpp()
    path = str(write(tmp_path / "m.gguf", "tiny", "Q8_0", seed=5, spm_model=spm_files["bpe-1000"][0]))
    ll = llama_cpp.Llama(model_path=path, n_ctx=256, logits_all=True, verbose=False, seed=0, n_threads=2)
    llm = LLM(path, kv_cache_memory="8MiB", kv_cache_dtype="fp32")
    n_new, compared, near_ties = 16, 0, 0
    for prompt in ["The quick brown fox", "def fibonacci(n):", "Москва — столица", "😀 emoji and 3.14159"]:
        ids = ll.tokenize(prompt.encode(), add_bos=True, special=True)
        ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True),
                            use_tqdm=False)[0]
        assert ours.prompt_token_ids == ids, prompt
        ll.reset()
        ll.eval(ids)
        for step, got in enumerate(ours.outputs[0].token_ids):
            logits = np.asarray(ll.scores[ll.n_tokens - 1], dtype=np.float64)
            top2 = np.sort(logits)[-2:]
            want = int(np.argmax(logits))
            if got != want:
                assert top2[1] - top2[0] < NEAR_TIE, (prompt, step, got, want, top2)
                near_ties += 1
                break
            compared += 1
            ll.eval([got])
    print(f"greedy: {compared} tokens equal to llama.cpp's, {near_ties} prompts parted at a near tie")
    assert compared >= 2 * n_new


def _stdlib_text(lo: int, hi: int) -> list[str]:
    """Real varied text on this machine: Python's standard library sources (code, docstrings)."""
    import pathlib
    import sysconfig

    files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[lo:hi]
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


@pytest.mark.parametrize("model_type,prefix", [("bpe", True), ("unigram", True), ("unigram", False)])
def test_large_vocab_on_real_text_equals_llama_cpp(tmp_path, model_type, prefix):
    """8000-token models trained on ~0.5 MB of real text, compared on other files in 2 kB pieces
    (and on the test texts): every token equal to llama.cpp's."""
    import io

    import sentencepiece as spm

    from kvserve.bench.gguf_vocab import write_vocab_only

    lines = [ln for t in _stdlib_text(0, 25) for ln in t.splitlines() if ln.strip()] + TEST_TEXTS * 3
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, model_type=model_type, vocab_size=8000,
        hard_vocab_limit=False, byte_fallback=True, character_coverage=0.9995, add_dummy_prefix=prefix,
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        num_threads=2, minloglevel=2)
    (tmp_path / "m.model").write_bytes(buf.getvalue())
    path = str(write_vocab_only(tmp_path / "m.gguf", tmp_path / "m.model"))
    texts = [t[i:i + 2000] for t in _stdlib_text(100, 106) for i in range(0, len(t), 2000)] + TEST_TEXTS
    n = _compare(path, texts)
    print(f"{model_type} prefix={prefix} vocab={len(_tok(path).hf.get_vocab())} "
          f"exact={_tok(path).exact_encoder is not None}: {n} tokens equal to llama.cpp's")
    assert n > 20000


def test_default_model_bpe_tokenization_equals_llama_cpp():
    """The byte-level BPE ('gpt2', pre 'smollm') path on the default model's file, same texts."""
    from kvserve.model.registry import resolve

    path = str(resolve(None).path)
    ll, tok = _vocab_only(path), _tok(path)
    n = 0
    for text in TEST_TEXTS:
        want = ll.tokenize(text.encode(), add_bos=False, special=True)
        assert tok.encode(text, add_special_tokens=False) == want, text
        n += len(want)
    assert n > 500
