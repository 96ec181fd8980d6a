"""A `checkpoint.pt` is read as data, never run: a pickle that would create a file (as one that
runs a shell command would) is refused by `kvserve quantize DIR` and by training resume, and the
file is never created; an honest checkpoint still resumes."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from kvserve.errors import InvalidRequest
from kvserve.train.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint


class _Payload:
    """Unpickles as a call to open(marker, "w"): a file appears if the pickle runs."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def hostile_dir(tmp_path: Path, fmt: str) -> tuple[Path, Path]:
    run = tmp_path / f"run-{fmt}"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    marker = tmp_path / f"marker-{fmt}"
    payload = {"model_config": {"model_type": "llama"}, "model": _Payload(marker)}
    if fmt == "torch":       # torch's zip format, as torch.save writes it
        torch.save(payload, run / CHECKPOINT_NAME)
    else:                    # a bare pickle stream
        (run / CHECKPOINT_NAME).write_bytes(pickle.dumps(payload))
    return run, marker


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("fmt", ["torch", "pickle"])
def test_a_pickle_payload_in_a_checkpoint_does_not_run(tmp_path, fmt):
    from kvserve.train.quantize import load_source

    run, marker = hostile_dir(tmp_path, fmt)
    assert fmt != "torch" or zipfile.is_zipfile(run / CHECKPOINT_NAME)
    with pytest.raises(InvalidRequest) as e:
        load_source(str(run))
    assert e.value.param == "model" and "plain data" in str(e.value)
    net = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(InvalidRequest) as e:
        load_checkpoint(run, model=net, optimizer=opt, scheduler=None)
    assert e.value.param == "resume"
    assert not marker.exists()


def test_kvserve_quantize_refuses_the_payload_in_one_line(tmp_path):
    run, marker = hostile_dir(tmp_path, "torch")
    p = subprocess.run([sys.executable, "-m", "kvserve.cli", "quantize", str(run), "--type", "q8_0",
                        "--out", str(tmp_path / "a.gguf"), "--no-eval"],
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "plain data" in p.stderr
    assert not marker.exists() and not (tmp_path / "a.gguf").exists()


def test_an_honest_checkpoint_still_resumes(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    net(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    save_checkpoint(tmp_path, model=net, optimizer=opt, scheduler=sched, step=7, data_state={"position": [3, 9]},
                    extra={"note": "x"})
    net2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(net2.parameters(), lr=0.01, betas=(0.9, 0.95))
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: min(1.0, (s + 1) / 4))
    got = load_checkpoint(tmp_path, model=net2, optimizer=opt2, scheduler=sched2)
    assert got == {"step": 7, "data": {"position": [3, 9]}, "extra": {"note": "x"}}
    assert torch.equal(net.weight, net2.weight)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"])
    assert sched2.last_epoch == sched.last_epoch
