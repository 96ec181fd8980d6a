"""SentencePiece models trained here on an inline corpus, written into vocab-only GGUF files the
way llama.cpp's converter writes them (kvserve.bench.gguf_vocab), for the tokenizer tests."""

from __future__ import annotations

import pytest
from spm_corpus import KINDS, train_spm


@pytest.fixture(scope="session")
def spm_files(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """kind name -> (sentencepiece .model path, vocab-only GGUF path)."""
    pytest.importorskip("sentencepiece", reason="the SPM tokenizer tests train models with sentencepiece")
    from kvserve.bench.gguf_vocab import write_vocab_only

    d = tmp_path_factory.mktemp("spm")
    out = {}
    for name, mtype, size, prefix in KINDS:
        model = train_spm(d / name, mtype, size, prefix)
        out[name] = (model, str(write_vocab_only(d / f"{name}.gguf", model)))
    return out
