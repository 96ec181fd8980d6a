"""Pretraining: next-token prediction with teacher forcing over packed sequences.

For every position t of a row the model sees tokens 0..t (the true ones, never its own
guesses: teacher forcing) and is charged cross-entropy on token t+1. One optimizer step:

    for each of grad_accum micro-batches:  loss = CE(model(x), y) / grad_accum;  loss.backward()
    average gradients across ranks (data parallel)  ->  clip global norm  ->  AdamW  ->  LR schedule

Deterministic on CPU for a given seed: the model is initialised from the seed, the data are
read in order from `PackedBatches.position`, and nothing random happens inside a step, so a
resumed run repeats the uninterrupted run's losses exactly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.model.decoder import DecoderLM
from kvserve.train.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint, saved_on_interrupt
from kvserve.train.common import (
    RunLog,
    all_reduce_mean,
    broadcast_params,
    init_distributed,
    make_optimizer,
    model_config,
    sync_gradients,
    trainable,
    unique_params,
    warmup_cosine,
)
from kvserve.train.data import PackedBatches, load_corpus, split_documents, tokenize_documents
from kvserve.train.evaluate import evaluate_stream, token_byte_lengths, unigram_bits_per_byte
from kvserve.train.export import export_hf
from kvserve.train.tokenizer_train import EOT, load_tokenizer, special_id


@dataclass
class PretrainConfig:
    tokenizer: str                       # directory with tokenizer.json (kvserve train tokenizer)
    out: str                             # output: HF model dir + checkpoint + logs
    corpus: str | None = None            # file or directory; None = the bundled public-domain corpus
    max_chars: int | None = None         # use only the first N characters of the corpus
    size: str = "tiny"                   # a key of MODEL_SIZES
    seq_len: int = 256
    batch_size: int = 16                 # rows per micro-batch, summed over all ranks
    grad_accum: int = 1                  # micro-batches per optimizer step
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_steps: int | None = None         # None: 1000, or fitted to --max-minutes after a few steps
    max_minutes: float | None = None
    eval_every: int = 100
    eval_windows: int = 32
    checkpoint_every: int = 100
    seed: int = 0
    resume: bool = False
    stop_after_steps: int | None = None  # leave the loop early, as an interruption would (tests)


class Schedule:
    """Warmup + cosine as a callable object, so LambdaLR saves `total_steps` in its state."""

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float):
        self.warmup_steps, self.total_steps, self.min_lr_ratio = warmup_steps, total_steps, min_lr_ratio

    def __call__(self, step: int) -> float:
        return warmup_cosine(self.warmup_steps, self.total_steps, self.min_lr_ratio)(step)


def pretrain(cfg: PretrainConfig) -> dict:
    info = init_distributed()
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    tok = load_tokenizer(cfg.tokenizer)
    eot = special_id(tok, EOT)
    train_docs, val_docs = split_documents(load_corpus(cfg.corpus, cfg.max_chars))
    train_ids = tokenize_documents(tok, train_docs, eot)
    val_ids = tokenize_documents(tok, val_docs, eot)
    token_bytes = token_byte_lengths(tok)

    mcfg = model_config(cfg.size, tok.vocab_size, tok.eos_token_ids, max(2048, cfg.seq_len))
    model = trainable(DecoderLM.random(mcfg, seed=cfg.seed))
    broadcast_params(model, info)
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay)
    total = cfg.max_steps or 1000
    schedule = Schedule(cfg.warmup_steps, total, cfg.min_lr_ratio)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    data = PackedBatches(train_ids, cfg.seq_len)
    start = 0
    if cfg.resume and find_checkpoint(out):
        state = load_checkpoint(out, model=model, optimizer=opt, scheduler=sched)
        start, data.position = state["step"], state["data"]["position"]
        total = schedule.total_steps

    log = RunLog(out, total, enabled=info.is_main, title="pretrain")
    n_params = sum(p.numel() for p in unique_params(model))
    unigram = unigram_bits_per_byte(train_ids, val_ids, token_bytes, tok.vocab_size)
    log.log("setup", start, params=n_params, train_tokens=len(train_ids), val_tokens=len(val_ids),
            unigram_bpb=unigram, world_size=info.world_size)
    log.start(start)
    fit_budget = cfg.max_minutes is not None and cfg.max_steps is None
    t_start = time.perf_counter()
    step = start

    def save() -> None:
        if info.is_main:
            save_checkpoint(out, model=model, optimizer=opt, scheduler=sched, step=step,
                            data_state={"position": data.position})

    def evaluate() -> dict:
        r = evaluate_stream(model, val_ids, token_bytes, cfg.seq_len, max_windows=cfg.eval_windows)
        m = {"val_loss": r.loss, "val_bpb": r.bits_per_byte, "unigram_bpb": unigram}
        log.log("eval", step, **m)
        return m

    with saved_on_interrupt(save, lambda: log.close(cfg)):
        while step < total:
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for _ in range(cfg.grad_accum):
                x, y = data.next_batch(cfg.batch_size, info.rank, info.world_size)
                logits = model.compute_logits(model(x))
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) / cfg.grad_accum
                loss.backward()
                loss_sum += loss.item()
            sync_gradients(model, info)
            gnorm = torch.nn.utils.clip_grad_norm_(unique_params(model), cfg.grad_clip)
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            loss_t = all_reduce_mean(torch.tensor(loss_sum), info)
            dt = time.perf_counter() - t0
            tokens = cfg.batch_size * cfg.grad_accum * cfg.seq_len
            log.log("train", step, loss=float(loss_t), lr=lr, grad_norm=float(gnorm), tok_per_s=tokens / dt)
            step += 1
            if fit_budget and step == start + 3:   # fit the schedule to the time budget
                per_step = (time.perf_counter() - t_start) / 3
                total = schedule.total_steps = max(step + 1, int(cfg.max_minutes * 60 / per_step))
                schedule.warmup_steps = min(schedule.warmup_steps, max(1, total // 10))
                log.set_total(total)
                log.log("budget", step, total_steps=total, sec_per_step=per_step)
            if info.is_main and (step % cfg.eval_every == 0 or step == total):
                evaluate()
            if step % cfg.checkpoint_every == 0:
                save()
            if cfg.max_minutes is not None and time.perf_counter() - t_start > cfg.max_minutes * 60:
                break
            if cfg.stop_after_steps is not None and step - start >= cfg.stop_after_steps:
                break
    save()
    result: dict = {"out": str(out), "steps": step, "params": n_params, "unigram_bpb": unigram,
                    "history": log.history}
    if info.is_main:
        result.update(evaluate() if not log.history or log.history[-1]["kind"] != "eval" else {
            k: log.history[-1][k] for k in ("val_loss", "val_bpb")})
        export_hf(model, cfg.tokenizer, out, tok.eos_token_ids)
    log.close(cfg)
    result["model"] = model
    return result
