"""Pieces every training stage shares: model sizes, AdamW, warmup+cosine, data parallelism,
token log-probs, and the run log (progress bar, JSON log lines, loss-curve PNG).

Every stage trains the serving model class itself (`DecoderLM`), so what is trained is
exactly what the engine runs. Data parallelism is plain torch.distributed: each rank computes
gradients on its slice of the global batch, then gradients are averaged with all_reduce before
the (replicated, identical) optimizer step; rank 0 alone writes files.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kvserve.errors import InvalidRequest
from kvserve.model.config import ModelConfig
from kvserve.model.decoder import DecoderLM

# Small Llama-style shapes (SmolLM2's recipe: tied embeddings, GQA, SwiGLU, RoPE), sized for CPU.
MODEL_SIZES: dict[str, dict] = {
    "nano": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2},
    "tiny": {"hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 6,
                 "num_key_value_heads": 2},
    "small": {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 6,
                  "num_key_value_heads": 2},
}


def model_config(size: str, vocab_size: int, eos_token_id: int | list[int] | None = None,
                 max_position_embeddings: int = 2048) -> ModelConfig:
    if size not in MODEL_SIZES:
        raise InvalidRequest(f"unknown model size {size!r}; choose one of {', '.join(MODEL_SIZES)}", param="size")
    return ModelConfig(architecture="llama", vocab_size=vocab_size, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
                       eos_token_id=eos_token_id, name=f"kvserve-{size}", **MODEL_SIZES[size])


def epoch_batch(cursor: int, n: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1) -> list[int]:
    """This rank's item indices for step `cursor` of a pass over n items, batch_size per step,
    reshuffled each epoch from (seed, epoch) so a resumed run draws the same batches."""
    per_epoch = max(1, n // batch_size)
    epoch, k = divmod(cursor, per_epoch)
    order = list(range(n))
    random.Random(seed * 1000003 + epoch).shuffle(order)
    chosen = order[k * batch_size:(k + 1) * batch_size]
    share = len(chosen) // world_size
    return chosen[rank * share:(rank + 1) * share]


def trainable(model: DecoderLM) -> DecoderLM:
    return model.requires_grad_(True).train()


def frozen(model: DecoderLM) -> DecoderLM:
    return model.requires_grad_(False).eval()


def unique_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))   # tied weights once


# ---- optimisation -------------------------------------------------------------------------
def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.1,
                   betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains are left alone)."""
    params = unique_params(model)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, foreach=False)


def warmup_cosine(warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1):
    """LR multiplier: linear warmup to 1, then cosine decay to `min_lr_ratio` at `total_steps`."""
    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return f


def make_scheduler(opt: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                   min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup_steps, total_steps, min_lr_ratio))


# ---- data parallelism ---------------------------------------------------------------------
@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistInfo:
    """Join the process group torchrun describes in the environment (gloo on CPU, nccl on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size())


def all_reduce_mean(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= info.world_size
    return t


def sync_gradients(model: torch.nn.Module, info: DistInfo) -> None:
    """Average gradients over ranks: one flat all_reduce (the DDP bucket, without the hooks)."""
    if info.world_size <= 1:
        return
    grads = [p.grad for p in unique_params(model) if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce_mean(flat, info)
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


def broadcast_params(model: torch.nn.Module, info: DistInfo) -> None:
    if info.world_size > 1:
        for p in unique_params(model):
            dist.broadcast(p.data, 0)


# ---- model helpers ------------------------------------------------------------------------
def token_logprobs(model: DecoderLM, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[b, t] | input_ids[b, :t+1]) for every position: [B, T]."""
    logits = model.compute_logits(model(input_ids)).float()
    return -F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")


@torch.no_grad()
def greedy_generate(model: DecoderLM, prompt_ids: list[int], max_new_tokens: int,
                    stop_ids: list[int]) -> list[int]:
    """Plain greedy decoding without a KV cache (for quick checks inside training code)."""
    was_training = model.training
    model.eval()
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(model.compute_logits(model(torch.tensor([ids]))[:, -1]).argmax(-1))
        if nxt in stop_ids:
            break
        out.append(nxt)
        ids.append(nxt)
    model.train(was_training)
    return out


def pad_rows(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    """Right-pad to one length; causal attention means padding never affects real positions."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long)


# ---- run log -------------------------------------------------------------------------------
@dataclass
class RunLog:
    """metrics.jsonl (one JSON object per event), loss_curve.png, and a rich progress bar."""

    out_dir: Path
    total_steps: int
    enabled: bool = True
    title: str = "train"
    history: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self._progress = None
        self._t0 = time.perf_counter()
        if self.enabled:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._file = (self.out_dir / "metrics.jsonl").open("a")

    def start(self, first_step: int = 0) -> None:
        if not self.enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(TextColumn(f"[bold]{self.title}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
        self._task = self._progress.add_task(self.title, total=self.total_steps, completed=first_step, info="")
        self._progress.start()

    def set_total(self, total_steps: int) -> None:
        self.total_steps = total_steps
        if self._progress is not None:
            self._progress.update(self._task, total=total_steps)

    def log(self, kind: str, step: int, **metrics) -> None:
        rec = {"kind": kind, "step": step, "time": round(time.perf_counter() - self._t0, 3), **metrics}
        self.history.append(rec)
        if not self.enabled:
            return
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._progress is not None:
            info = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                             for k, v in metrics.items() if k in _SHOWN)
            self._progress.update(self._task, completed=step + 1 if kind == "train" else None, info=info)

    def close(self, config: object | None = None) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        self._file.close()
        if config is not None:
            cfg = asdict(config) if is_dataclass(config) else dict(config)
            (self.out_dir / "train_config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")
        plot_losses(self.history, self.out_dir / "loss_curve.png", self.title)


_SHOWN = ("loss", "val_loss", "val_bpb", "tok_per_s", "reward", "acc", "margin", "lr")


def plot_losses(history: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["loss"]) for r in history if r["kind"] == "train" and "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in history if r["kind"] == "eval" and "val_loss" in r]
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="held-out loss")
    reward = [(r["step"], r["reward"]) for r in history if r["kind"] == "train" and "reward" in r]
    if reward:
        ax2 = ax.twinx()
        ax2.plot(*zip(*reward), color="tab:green", label="mean reward")
        ax2.set_ylabel("reward")
        ax2.legend(loc="upper right")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_curves(history: list[dict], path: Path, keys: tuple[str, ...], title: str) -> None:
    """One panel per logged training metric in `keys` that the run has (e.g. reward, KL, loss)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {k: [(r["step"], r[k]) for r in history if r["kind"] == "train" and k in r] for k in keys}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return
    fig, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3.2), squeeze=False)
    for ax, (k, pts) in zip(axes[0], series.items()):
        ax.plot(*zip(*pts), lw=1)
        ax.set_title(k)
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
