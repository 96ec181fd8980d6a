"""Checkpoints that resume bit-exactly: model, optimizer, scheduler, RNG states, step, data position.

A resumed run must produce the same losses as an uninterrupted one, so everything that feeds
the next step is saved: weights and AdamW moments, the LR schedule's position, the data cursor
(`PackedBatches.position` or a stage's own), and the torch / Python RNG states (sampling in
GRPO, shuffling in SFT/DPO). Written atomically (tmp file + rename) so a crash mid-save never
leaves a half checkpoint as the latest.

A checkpoint is read as data only (`torch.load(weights_only=True)`: tensors, numbers, strings,
containers): a `checkpoint.pt` in a directory someone else made is not trusted as code, so a
pickle that would build any other object (and so could run a command) is refused, not run.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvserve.errors import InvalidRequest

CHECKPOINT_NAME = "checkpoint.pt"


@contextmanager
def saved_on_interrupt(save: Callable[[], None], close: Callable[[], None]) -> Iterator[None]:
    """Ctrl-C inside the block saves a checkpoint and closes the run's log before it goes on up,
    so `--resume` continues from the step reached."""
    try:
        yield
    except KeyboardInterrupt:
        save()
        close()
        raise


def save_checkpoint(out_dir: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, step: int, data_state: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "model": model.state_dict(),
        "model_config": model.config.to_hf_dict() if hasattr(model, "config") else None,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "data": data_state,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "extra": extra or {},
    }
    path = out / CHECKPOINT_NAME
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def read_checkpoint(path: Path, param: str) -> Any:
    """The saved state as plain data; an `InvalidRequest` naming `param` if the file needs more
    than tensors and containers to unpickle (a hostile or foreign pickle) or is not one at all."""
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InvalidRequest(f"{path} is not a kvserve checkpoint that loads as plain data (tensors and "
                             f"containers only; nothing in it is run): {first[:200]}", param=param) from None


def find_checkpoint(out_dir: str | Path) -> Path | None:
    p = Path(out_dir) / CHECKPOINT_NAME
    return p if p.is_file() else None


def load_checkpoint(path: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any) -> dict[str, Any]:
    """Restore everything in place; returns {"step", "data", "extra"} for the caller's loop."""
    p = Path(path)
    if p.is_dir():
        p = p / CHECKPOINT_NAME
    if not p.is_file():
        raise InvalidRequest(f"no checkpoint at {p}: nothing to resume (run without --resume to start fresh)",
                             param="resume")
    state = read_checkpoint(p, "resume")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return {"step": state["step"], "data": state["data"], "extra": state["extra"]}
