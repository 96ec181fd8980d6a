"""GGUF SentencePiece ('llama') tokenizers: built from the file alone, equal to sentencepiece where
its BPE encoding is llama.cpp's algorithm, decoding back to the text (also incrementally).
The comparison with llama.cpp itself is in test_gguf_spm_llama_cpp.py (slow)."""

from __future__ import annotations

import pytest
from spm_corpus import KINDS, TEST_TEXTS

from kvserve.errors import ModelLoadError
from kvserve.tokenizer.detokenizer import IncrementalDetokenizer
from kvserve.tokenizer.tokenizer import Tokenizer

SPECIAL_IN_TEXT = ("<start_of_turn>", "<end_of_turn>", "<tool>", "<s>", "</s>", "<unk>")
PLAIN_TEXTS = [t for t in TEST_TEXTS if not any(s in t for s in SPECIAL_IN_TEXT)]


def _tok(path: str) -> Tokenizer:
    from kvserve.model.gguf_loader import open_gguf

    return Tokenizer.from_gguf(open_gguf(path))


@pytest.mark.parametrize("kind", [k[0] for k in KINDS if k[1] == "bpe"])
def test_equals_sentencepiece_bpe(spm_files, kind):
    """A SentencePiece BPE model encodes by llama.cpp's rule (score-ranked pair merges, byte
    fallback); with identity normalization its ids are the truth for plain text."""
    import sentencepiece as spm

    model, gguf_path = spm_files[kind]
    sp, tok = spm.SentencePieceProcessor(model_file=model), _tok(gguf_path)
    compared = 0
    for text in PLAIN_TEXTS:
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), repr(text)
        compared += len(sp.encode(text))
    assert compared > 500


@pytest.mark.parametrize("kind", [k[0] for k in KINDS])
def test_round_trip_and_byte_fallback(spm_files, kind):
    tok = _tok(spm_files[kind][1])
    for text in PLAIN_TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id          # add_bos_token, written as llama.cpp's converter does
        assert tok.decode(ids) == text, repr(text)
    # characters the model never saw are spelled as <0xXX> byte tokens, and come back whole
    ids = tok.encode("🦩ሰ", add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert sum(p.startswith("<0x") for p in pieces) >= 7, pieces
    assert tok.decode(ids) == "🦩ሰ"


@pytest.mark.parametrize("kind", ["bpe-1000", "unigram-1500-noprefix"])
def test_incremental_detokenizer(spm_files, kind):
    """Streaming one token at a time gives the full decode: byte-fallback pieces wait for the rest
    of their character, and the space a piece begins with is kept after the first piece."""
    tok = _tok(spm_files[kind][1])
    prompt = tok.encode("Once upon a time")
    for text in PLAIN_TEXTS:
        ids = tok.encode(" " + text, add_special_tokens=False)
        det = IncrementalDetokenizer(tok, prompt)
        out = "".join(det.add_tokens([i]) for i in ids) + det.flush()
        assert out == tok.decode(prompt + ids)[len(tok.decode(prompt)):], repr(text)
        assert "\ufffd" not in out


def test_control_and_user_defined_tokens(spm_files):
    """Control tokens in text are one token each and skipped when decoding; a user-defined one
    is one token and kept; Gemma's variant (no space prefix) prefixes nothing after them."""
    for kind in ("bpe-1000", "bpe-2000-noprefix"):
        tok = _tok(spm_files[kind][1])
        vocab = tok.hf.get_vocab()
        sot, eot, tool = vocab["<start_of_turn>"], vocab["<end_of_turn>"], vocab["<tool>"]
        ids = tok.encode("<start_of_turn>user\nhi<end_of_turn><tool>x", add_special_tokens=False)
        assert ids[0] == sot and eot in ids and tool in ids
        assert sot in tok.all_special_ids and tool not in tok.all_special_ids
        assert eot in tok.eos_token_ids                      # ends a turn
        text = tok.decode(ids)
        assert "<start_of_turn>" not in text and "<tool>" in text
        after = tok.convert_ids_to_tokens(ids[1:2])[0]
        assert after.startswith("\u2581") == (kind == "bpe-1000"), after


def test_add_space_prefix_false_like_gemma(spm_files, tmp_path):
    """A file that says add_space_prefix=false (Gemma's) does not prefix a space, whatever the
    SentencePiece model said, and does not strip one when decoding."""
    from kvserve.bench.gguf_vocab import write_vocab_only

    model = spm_files["bpe-1000"][0]
    tok = _tok(str(write_vocab_only(tmp_path / "g.gguf", model, add_space_prefix=False)))
    ref = _tok(spm_files["bpe-1000"][1])
    ids = tok.encode("hello world", add_special_tokens=False)
    assert not tok.convert_ids_to_tokens(ids)[0].startswith("\u2581")
    assert ref.convert_ids_to_tokens(ref.encode("hello world", add_special_tokens=False))[0].startswith("\u2581")
    assert tok.decode(tok.encode(" x y", add_special_tokens=False)) == " x y"


def test_cached_tokenizer_is_the_same(spm_files, tmp_path, monkeypatch):
    """The model loader caches the built tokenizer (as the BPE one): built and written once, read
    back after, tokenizing and decoding alike."""
    from kvserve.model.gguf_loader import open_gguf
    from kvserve.model.kernels import pack_cache
    from kvserve.model.loader import _gguf_tokenizer

    monkeypatch.setenv("KVSERVE_PACK_CACHE", "1")
    monkeypatch.setattr(pack_cache, "cache_root", lambda: tmp_path / "packed")
    path = spm_files["unigram-600"][1]
    reader = open_gguf(path)
    fresh = Tokenizer.from_gguf(reader)
    first, again = _gguf_tokenizer(path, reader), _gguf_tokenizer(path, reader)    # builds and writes; reads
    assert len(list((tmp_path / "packed").glob("*.tokenizer.json"))) == 1
    for tok in (first, again):
        assert (tok.bos_token_id, tok.eos_token_ids, tok.all_special_ids, tok.add_bos) == (
            fresh.bos_token_id, fresh.eos_token_ids, fresh.all_special_ids, fresh.add_bos)
        for text in TEST_TEXTS:
            assert tok.encode(text) == fresh.encode(text)
            assert tok.decode(fresh.encode(text)) == fresh.decode(fresh.encode(text))


def test_unsupported_model_says_what_to_do(tmp_path):
    import gguf

    from kvserve.model.gguf_loader import open_gguf

    w = gguf.GGUFWriter(str(tmp_path / "t5.gguf"), "t5")
    w.add_tokenizer_model("t5")
    w.add_token_list(["<pad>", "</s>", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF tokenizer model 't5'.*tokenizer.json"):
        Tokenizer.from_gguf(open_gguf(str(tmp_path / "t5.gguf")))


@pytest.mark.parametrize("kind", [k[0] for k in KINDS])
def test_bpe_and_exact_encoders_agree(spm_files, kind):
    """The `tokenizers` BPE and the transcription of llama.cpp's encoder (spm_exact.py, used where
    scores tie) give the same ids on every test text, special tokens included."""
    from kvserve.model.gguf_loader import open_gguf
    from kvserve.tokenizer.spm_exact import SpmEncoder
    from kvserve.tokenizer.tokenizer import gguf_field

    reader = open_gguf(spm_files[kind][1])

    def f(key):
        return list(gguf_field(reader, key))

    exact = SpmEncoder(f("tokenizer.ggml.tokens"), f("tokenizer.ggml.scores"), f("tokenizer.ggml.token_type"),
                       add_space_prefix=bool(gguf_field(reader, "tokenizer.ggml.add_space_prefix")))
    tok = _tok(spm_files[kind][1])
    tok.exact_encoder = None                 # the BPE alone
    for text in TEST_TEXTS:
        assert tok.hf.encode(text).ids == exact.encode(text), repr(text)


def test_engine_process_spec_keeps_the_encoder(spm_files):
    """The serving front-end rebuilds the tokenizer from the engine process's spec (msgpack): the
    exact encoder and add_eos come along."""
    import msgspec

    from kvserve.engine.process import tokenizer_from_spec, tokenizer_spec
    from kvserve.model.gguf_loader import open_gguf
    from kvserve.tokenizer.spm_exact import SpmEncoder
    from kvserve.tokenizer.tokenizer import gguf_field

    for kind in ("unigram-600", "bpe-1000"):
        tok = _tok(spm_files[kind][1])
        tok.add_eos = True
        if kind.startswith("unigram"):      # as a file whose scores tie gets it
            reader = open_gguf(spm_files[kind][1])
            tok.exact_encoder = SpmEncoder(*(list(gguf_field(reader, f"tokenizer.ggml.{k}"))
                                             for k in ("tokens", "scores", "token_type")), add_space_prefix=True)
        spec = msgspec.msgpack.decode(msgspec.msgpack.encode(tokenizer_spec(tok)))
        again = tokenizer_from_spec(spec)
        assert (again.exact_encoder is None) == (tok.exact_encoder is None)
        assert (again.chat_template, again.has_chat_template) == (tok.chat_template, tok.has_chat_template)
        for text in TEST_TEXTS:
            assert again.encode(text) == tok.encode(text)


def test_chat_template_from_the_file_else_raw_completion(spm_files, tmp_path):
    """`tokenizer.chat_template` is the chat format; a SentencePiece file without one renders the
    messages as plain text after BOS (no ChatML markup its vocabulary cannot spell)."""
    from kvserve.bench.gguf_vocab import write_vocab_only

    model = spm_files["bpe-1000"][0]
    msgs = [{"role": "user", "content": "Once upon a time"}]
    raw = _tok(spm_files["bpe-1000"][1])
    assert not raw.has_chat_template
    assert raw.apply_chat_template(msgs) == "<s>Once upon a time"
    assert raw.apply_chat_template(msgs, tokenize=True) == raw.encode("Once upon a time")
    gemma = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
             "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    tok = _tok(str(write_vocab_only(tmp_path / "t.gguf", model, add_space_prefix=False, chat_template=gemma)))
    assert tok.has_chat_template
    ids = tok.apply_chat_template(msgs, tokenize=True)
    vocab = tok.hf.get_vocab()
    assert ids[:2] == [tok.bos_token_id, vocab["<start_of_turn>"]]
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == "<s><start_of_turn>user\nOnce upon a time<end_of_turn>\n<start_of_turn>model\n"


def test_token_text_keeps_the_pieces_space(spm_files):
    """A token's own text (logprobs, traces) is llama.cpp's piece: '▁the' is ' the', though a whole
    decode drops the space the prefix added before the first piece."""
    tok = _tok(spm_files["bpe-1000"][1])
    ids = tok.encode("the cat", add_special_tokens=False)
    texts = [tok.token_text(i) for i in ids]
    assert texts[0].startswith(" ") and "".join(texts) == " the cat"
    assert tok.decode(ids) == "the cat"
