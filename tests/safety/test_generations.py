"""The benign windows output moderation sees, as safety/generations.py cuts them (real tokenizer)."""

import gguf

from kvserve.model.registry import resolve
from kvserve.safety.generations import EVAL_PROMPTS, GENERATED_PATH, TRAIN_PROMPTS, windows
from kvserve.tokenizer import Tokenizer


def test_windows_are_the_stage_checks():
    tok = Tokenizer.from_gguf(gguf.GGUFReader(resolve(None).path))
    ids = tok.encode("word " * 120, add_special_tokens=False)[:70]
    ws = windows(tok, ids, every=16, chars=256)
    assert len(ws) == 5                                     # tokens 16, 32, 48, 64 and the end (70)
    assert ws[0] == tok.decode(ids[:16]) and ws[-1] == tok.decode(ids)[-256:]
    assert all(len(w) <= 256 for w in ws)


def test_fresh_prompts_are_not_training_prompts():
    assert not set(EVAL_PROMPTS) & set(TRAIN_PROMPTS)
    lines = [x for x in GENERATED_PATH.read_text().splitlines() if not x.startswith("#")]
    assert len(lines) >= 1000 and len(set(lines)) == len(lines)
