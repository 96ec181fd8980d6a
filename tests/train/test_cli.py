"""The commands as a user types them, in a real subprocess."""

import json
import subprocess
import sys


def _kvserve(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from kvserve.cli import main; sys.argv = ['kvserve', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], check=False, capture_output=True, text=True, timeout=300)


def test_train_tokenizer_then_eval_perplexity(base_run, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("In the beginning was the word. 🌍\n\n" * 50 + "And the word was with them.\n\n" * 50)
    p = _kvserve("train", "tokenizer", "--corpus", str(corpus), "--vocab-size", "300", "--out", str(tmp_path / "tok"))
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["vocab_size"] <= 300 and report["heldout_bytes_per_token"] > 1.0
    assert (tmp_path / "tok" / "tokenizer.json").is_file()

    p = _kvserve("eval", "perplexity", "--model", base_run["out"], "--max-windows", "4", "--seq-len", "64")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["tokens"] == 4 * 64 and 1.0 < r["perplexity"] < 512 and r["bits_per_byte"] > 0


def test_missing_data_is_a_clear_error(base_run, tmp_path):
    p = _kvserve("train", "sft", "--model", base_run["out"], "--data", str(tmp_path / "nope.jsonl"),
                 "--out", str(tmp_path / "o"))
    assert p.returncode == 1 and "does not exist" in p.stderr
