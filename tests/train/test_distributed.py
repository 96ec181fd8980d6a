"""Two-process data-parallel pretraining (gloo, launched with torchrun) equals one process with the
same global batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.train.pretrain import pretrain

ARGS = {"size": "nano", "seq_len": 32, "batch_size": 8, "max_steps": 6, "lr": 5e-3, "warmup_steps": 2,
        "max_chars": 100_000, "eval_every": 1000, "checkpoint_every": 1000}


def _train_losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


def test_two_gloo_processes_match_one_process(tok_dir, tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.is_file():
        pytest.skip("torchrun is not installed next to this interpreter")
    cli = [f"--{k.replace('_', '-')}={v}" for k, v in ARGS.items() if k not in ("eval_every", "checkpoint_every")]
    cmd = [str(torchrun), "--standalone", "--nproc_per_node=2", "-m", "kvserve.train", "pretrain",
           f"--tokenizer={tok_dir}", f"--out={tmp_path / 'ddp'}", "--threads=1", "--eval-every=1000",
           "--checkpoint-every=1000", *cli]
    scratch = tmp_path / "tmp"   # torchrun's agent makes a torchelastic_* dir there and leaves it
    scratch.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert next(r for r in rows if r["kind"] == "setup")["world_size"] == 2

    from kvserve.train.pretrain import PretrainConfig

    single = pretrain(PretrainConfig(tokenizer=str(tok_dir), out=str(tmp_path / "one"), **ARGS))
    want = [h["loss"] for h in single["history"] if h["kind"] == "train"]
    got = _train_losses(tmp_path / "ddp")
    assert len(got) == len(want) == ARGS["max_steps"]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert (tmp_path / "ddp" / "model.safetensors").is_file()     # rank 0 exported
