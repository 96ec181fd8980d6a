"""The optimisation loop the fine-tuning stages (SFT, DPO, GRPO) share.

A stage supplies `step_fn(step) -> metrics`: it draws its own batch, runs forward and
backward (gradients accumulate into the parameters) and returns numbers to log, "loss"
among them. The loop does the rest, identically for every stage: zero grads, average them
across ranks, clip, AdamW, LR schedule, log, checkpoint every N steps and at the end (or on
Ctrl-C), so `--resume` continues where the run stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.train.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint, saved_on_interrupt
from kvserve.train.common import (
    DistInfo,
    RunLog,
    make_optimizer,
    make_scheduler,
    sync_gradients,
    unique_params,
)


@dataclass
class LoopConfig:
    out: str
    max_steps: int
    lr: float
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    checkpoint_every: int = 100
    resume: bool = False
    stop_after_steps: int | None = None
    title: str = "train"

    @classmethod
    def for_stage(cls, stage, total: int, title: str, **kw) -> LoopConfig:
        """The loop a stage's config asks for through its fields of the same names, `total` steps
        long, the warmup at most half of them."""
        return cls(out=stage.out, max_steps=total, lr=stage.lr, warmup_steps=min(stage.warmup_steps, total // 2),
                   weight_decay=stage.weight_decay, grad_clip=stage.grad_clip,
                   checkpoint_every=stage.checkpoint_every, resume=stage.resume,
                   stop_after_steps=stage.stop_after_steps, title=title, **kw)


@dataclass
class FinetuneConfig:
    """What SFT and DPO both take: a model and a JSONL data file (each stage says its fields),
    batching, the optimiser, a LoRA/QLoRA adapter instead of full training, checkpoints."""

    model: str                     # HF-format directory
    data: str                      # JSONL, one example per line
    out: str
    epochs: int = 3
    max_steps: int | None = None   # None: epochs * batches per epoch
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_len: int = 512
    seed: int = 0
    lora_rank: int = 0             # > 0: train a LoRA adapter of this rank on a frozen base (train/lora.py)
    lora_targets: str | None = None   # q,k,v,o,gate,up,down (default: all seven)
    lora_alpha: float | None = None   # default 2 * rank
    qlora: bool = False            # the frozen base in 4 bits (GGUF q4_0 on kvserve's kernels)
    checkpoint_every: int = 100
    resume: bool = False
    stop_after_steps: int | None = None


def run_loop(model: torch.nn.Module, cfg: LoopConfig, step_fn: Callable[[int], dict],
             data_state: Callable[[], dict], restore_data: Callable[[dict], None],
             info: DistInfo | None = None, run_config: object | None = None) -> RunLog:
    info = info or DistInfo()
    out = Path(cfg.out)
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay)
    sched = make_scheduler(opt, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    start = 0
    if cfg.resume and find_checkpoint(out):
        state = load_checkpoint(out, model=model, optimizer=opt, scheduler=sched)
        start = state["step"]
        restore_data(state["data"])
    log = RunLog(out, cfg.max_steps, enabled=info.is_main, title=cfg.title)
    log.start(start)
    step = start

    def save() -> None:
        if info.is_main:
            save_checkpoint(out, model=model, optimizer=opt, scheduler=sched, step=step, data_state=data_state())

    with saved_on_interrupt(save, lambda: log.close(run_config)):
        while step < cfg.max_steps:
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            metrics = step_fn(step)
            sync_gradients(model, info)
            gnorm = torch.nn.utils.clip_grad_norm_(unique_params(model), cfg.grad_clip)
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            dt = time.perf_counter() - t0
            if "tokens" in metrics:
                metrics["tok_per_s"] = metrics.pop("tokens") / dt
            log.log("train", step, lr=lr, grad_norm=float(gnorm), **metrics)
            step += 1
            if step % cfg.checkpoint_every == 0:
                save()
            if cfg.stop_after_steps is not None and step - start >= cfg.stop_after_steps:
                break
    save()
    log.close(run_config)
    return log
