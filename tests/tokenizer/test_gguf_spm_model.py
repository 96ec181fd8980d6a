"""A random-weight llama-architecture GGUF carrying a SentencePiece vocabulary loads and runs with
no other file (LLM(FILE) and `kvserve run --model FILE --raw`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def spm_model_file(spm_files, tmp_path_factory) -> str:
    from kvserve.bench.gguf_random import write

    path = tmp_path_factory.mktemp("spm_model") / "tiny-spm.gguf"
    return str(write(path, "tiny", "Q8_0", seed=3, spm_model=spm_files["bpe-1000"][0]))


def test_llm_loads_spm_gguf_alone(spm_model_file, spm_files):
    import sentencepiece as spm

    from kvserve import LLM, SamplingParams

    llm = LLM(spm_model_file, kv_cache_memory="8MiB")
    tok = llm.get_tokenizer()
    sp = spm.SentencePieceProcessor(model_file=spm_files["bpe-1000"][0])
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == [sp.bos_id(), *sp.encode(PROMPT)]
    assert len(out.outputs[0].token_ids) == 8
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)


def test_cli_run_raw_on_spm_gguf(spm_model_file):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, "-m", "kvserve.cli", "run", "--model", spm_model_file, "--max-tokens", "4",
                        "--temperature", "0", "--raw", PROMPT], capture_output=True, text=True, timeout=600,
                       env=env, stdin=subprocess.DEVNULL, check=False)
    assert r.returncode == 0, r.stderr
    assert "unsupported GGUF tokenizer" not in r.stderr
