"""`kvserve train tokenizer|pretrain|sft|dpo|reward|grpo` and `kvserve eval perplexity`.

Each subcommand is a thin layer over its stage's config dataclass; the same commands run under
`torchrun --nproc_per_node N -m kvserve.train ...` for data-parallel training.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any

import typer

from kvserve.cli_errors import fail, user_errors

train_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Train models kvserve serves: tokenizer, pretraining, SFT, DPO, reward model, GRPO, "
                             "speculative drafts.")
eval_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Evaluate models.")

OUT = typer.Option(..., "--out", help="Output directory (HF-format model, checkpoint, metrics.jsonl, loss_curve.png).")
RESUME = typer.Option(False, "--resume", help="Continue from the checkpoint in --out.")
LORA_RANK = typer.Option(0, "--lora-rank", min=0, help="Train a LoRA adapter of this rank on the frozen base "
                                                       "(saved in PEFT's layout in --out).")
LORA_TARGETS = typer.Option(None, "--lora-targets", help="Projections to adapt: q,k,v,o,gate,up,down (default all).")
LORA_ALPHA = typer.Option(None, "--lora-alpha", help="LoRA scale numerator (default 2 x rank).")
QLORA = typer.Option(False, "--qlora", help="QLoRA: the frozen base in 4 bits (kvserve's q4_0 kernels); "
                                            "rank 8 unless --lora-rank.")


def _summary(result: dict, keys: tuple[str, ...]) -> None:
    shown = {k: result[k] for k in keys if k in result}
    typer.echo(json.dumps(shown, indent=2, default=str))


def _threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def _config(cls: type, params: dict, **override: Any) -> Any:
    """A stage's config dataclass from a command's parameters: each field from the parameter of its
    name (the command's options are named as the config's fields), `override` for the others or in
    place of a parameter."""
    names = {f.name for f in fields(cls)}
    return cls(**{**{k: v for k, v in params.items() if k in names}, **override})


def _run_stage(threads: int | None, stage: Callable[[], dict], keys: tuple[str, ...]) -> None:
    """Run a training stage on `threads` torch threads; a user error prints `error: ...` and
    exits 1, a result prints its `keys` as JSON."""
    _threads(threads)
    with user_errors():
        result = stage()
    _summary(result, keys)


@train_app.command("draft")
def draft_cmd(
    out: str = typer.Option(..., "--out", help="Output directory: the draft model (HF format) and draft_vocab.json."),
    target: str = typer.Option(None, "--target", help="The target model (default: the built-in one)."),
    kind: str = typer.Option("layers", "--kind", help="layers: a small model of the target's layers; eagle: an "
                                                     "EAGLE head reading the target's features."),
    layers: str = typer.Option("first,last", help="The target's layers the draft starts from: first, last, indices "
                                                  "(eagle: one layer, default the last)."),
    feature_layers: str = typer.Option("", "--feature-layers", help="eagle: inner target layers the head reads "
                                                                      "beside the final one, e.g. 2,14,26 (EAGLE-3)."),
    vocab_size: int = typer.Option(4096, "--vocab-size", help="LM-head rows kept: the target's most used tokens "
                                                              "(0: the whole vocabulary)."),
    eagle_steps: int = typer.Option(2, "--eagle-steps", help="eagle: chained draft steps trained, as served (1: the "
                                                            "first only, from the target's features)."),
    init: str = typer.Option(None, "--init", help="eagle: continue from the head saved in this directory (its "
                                                  "vocabulary and feature layers)."),
    num_prompts: int = typer.Option(320, "--num-prompts", help="Built-in chat prompts the target answers."),
    gen_tokens: int = typer.Option(192, "--gen-tokens", help="Tokens the target writes per prompt."),
    temperature: float = typer.Option(0.7, help="Temperature of the sampled answers."),
    greedy_share: float = typer.Option(0.5, "--greedy-share", help="Share of the prompts answered greedily."),
    self_prompt_share: float = typer.Option(0.0, "--self-prompts", help="Share of the prompts the target writes "
                                                                        "itself (sampled user turns), 0..1."),
    steps: int = typer.Option(600),
    batch_size: int = typer.Option(8, "--batch-size"),
    lr: float = typer.Option(3e-4),
    seed: int = typer.Option(0),
    threads: int = typer.Option(1, help="PyTorch threads for the teacher pass and the distillation."),
) -> None:
    """Distil a small draft model for `--speculative draft:DIR` from the target, on the target's own text."""
    from kvserve.train.draft import DraftConfig, train_draft

    params = locals()
    with user_errors():
        r = train_draft(_config(DraftConfig, params))
    typer.echo(json.dumps(r, indent=2))


@train_app.command("router")
def router_cmd(
    out: str = typer.Option("router.json", "--out", help="Where the classifier (JSON) goes."),
    data: str = typer.Option(None, "--data", help="JSONL of {\"prompt\", \"label\": 0|1|\"easy\"|\"hard\"}; "
                                                   "default: the built-in labelled prompts."),
    layers: int = typer.Option(2, "--layers", help="Encoder layers under the feature (0-6; 6 = the full "
                                                   "embedding). Fewer is a faster router."),
) -> None:
    """Train the model router's classifier (logistic regression over sentence-encoder features)."""
    from kvserve.train.router_training import labelled_prompts, read_labelled, train_router

    with user_errors():
        rows = read_labelled(data) if data else labelled_prompts()
        clf = train_router(rows, layers=layers)
    Path(out).write_text(json.dumps(clf))
    _summary({"out": out, **clf}, ("out", "examples", "layers", "heldout_accuracy", "handwritten_accuracy",
                                   "classes"))


@train_app.command("cache-head")
def cache_head_cmd(
    out: str = typer.Option("cache_head.npz", "--out", help="Where the head (npz) goes; serve it with the "
                                                           "config file's \"semantic_cache\": {\"head\": PATH}."),
    hidden: int = typer.Option(1536, "--hidden", min=16, max=8192, help="Width of the head's hidden layer."),
    steps: int = typer.Option(1500, "--steps", min=1, max=100_000),
    seed: int = typer.Option(0, "--seed"),
    pos_margin: float = typer.Option(0.985, "--pos-margin", min=0.0, max=1.0,
                                     help="Paraphrase pairs are pulled above this cosine."),
    members: int = typer.Option(2, "--members", min=1, max=16, help="Heads trained (one seed each) and averaged."),
) -> None:
    """Train the semantic cache's embedding head (paraphrases to cosine >= 0.95) on generated paraphrases.

    Measure it with `python -m kvserve.bench.semantic_pairs --head PATH 0.95 0.93`."""
    from kvserve.train.cache_head import save_head, train_cache_head

    if not Path(out).resolve().parent.is_dir():    # before minutes of training, not after
        fail(f"cannot write {out}: its directory does not exist")
    head = train_cache_head(hidden=hidden, steps=steps, seed=seed, pos_margin=pos_margin, members=members)
    with user_errors(os_error=lambda e: f"cannot write {out}: {e}"):
        digest = save_head(head, out, hidden=hidden, steps=steps, seed=seed, pos_margin=pos_margin, members=members)
    typer.echo(json.dumps({"out": out, "digest": digest,
                           "measure": f"python -m kvserve.bench.semantic_pairs --head {out} 0.95 0.93"}, indent=2))


@train_app.command("tokenizer")
def tokenizer_cmd(
    out: str = OUT,
    corpus: str = typer.Option(None, help="Text file or directory; default: the bundled public-domain corpus."),
    vocab_size: int = typer.Option(4096, "--vocab-size"),
    max_chars: int = typer.Option(None, "--max-chars", help="Use only the first N characters."),
) -> None:
    """Train a byte-level BPE tokenizer with ChatML special tokens; reports compression."""
    from kvserve.train.data import load_corpus, split_documents
    from kvserve.train.tokenizer_train import bytes_per_token, save_tokenizer, train_tokenizer

    with user_errors():
        train, held = split_documents(load_corpus(corpus, max_chars))
        tok = train_tokenizer(train, vocab_size)
        save_tokenizer(tok, out)
    held_text = "\n\n".join(held)
    typer.echo(json.dumps({"out": out, "vocab_size": tok.get_vocab_size(),
                           "train_bytes_per_token": round(bytes_per_token(tok, "\n\n".join(train[:200])), 3),
                           "heldout_bytes_per_token": round(bytes_per_token(tok, held_text), 3)}, indent=2))


@train_app.command("pretrain")
def pretrain_cmd(
    out: str = OUT,
    tokenizer: str = typer.Option(..., help="Directory written by `kvserve train tokenizer`."),
    corpus: str = typer.Option(None, help="Text file or directory; default: the bundled corpus."),
    size: str = typer.Option("tiny", help="nano | tiny | small"),
    seq_len: int = typer.Option(256, "--seq-len"),
    batch_size: int = typer.Option(16, "--batch-size", help="Rows per micro-batch, over all processes."),
    grad_accum: int = typer.Option(1, "--grad-accum"),
    lr: float = typer.Option(3e-3),
    warmup_steps: int = typer.Option(20, "--warmup-steps"),
    max_steps: int = typer.Option(None, "--max-steps", help="Default 1000, or fitted to --max-minutes."),
    max_minutes: float = typer.Option(None, "--max-minutes"),
    max_chars: int = typer.Option(None, "--max-chars"),
    eval_every: int = typer.Option(100, "--eval-every"),
    checkpoint_every: int = typer.Option(100, "--checkpoint-every"),
    seed: int = typer.Option(0),
    threads: int = typer.Option(None, help="torch threads per process."),
    resume: bool = RESUME,
) -> None:
    """Pretrain a small Llama-style model with teacher forcing on packed sequences."""
    from kvserve.train.pretrain import PretrainConfig, pretrain

    params = locals()
    _threads(threads)
    with user_errors():
        r = pretrain(_config(PretrainConfig, params))
    if "val_bpb" in r:
        _summary(r, ("out", "steps", "params", "val_loss", "val_bpb", "unigram_bpb"))


@train_app.command("sft")
def sft_cmd(
    model: str = typer.Option(..., help="HF-format model directory (e.g. the pretrain output)."),
    data: str = typer.Option(..., help='JSONL: {"messages": [{"role": ..., "content": ...}, ...]} per line.'),
    out: str = OUT,
    epochs: int = typer.Option(3),
    max_steps: int = typer.Option(None, "--max-steps"),
    batch_size: int = typer.Option(8, "--batch-size"),
    lr: float = typer.Option(1e-3),
    max_len: int = typer.Option(512, "--max-len"),
    seed: int = typer.Option(0),
    debug: bool = typer.Option(False, help="Print the first example with its trained tokens in «»."),
    threads: int = typer.Option(None),
    resume: bool = RESUME,
    lora_rank: int = LORA_RANK, lora_targets: str = LORA_TARGETS, lora_alpha: float = LORA_ALPHA, qlora: bool = QLORA,
) -> None:
    """Supervised fine-tuning on chats; loss on assistant tokens only."""
    from kvserve.train.sft import SFTConfig, sft

    params = locals()
    _run_stage(threads, lambda: sft(_config(SFTConfig, params)), ("out", "steps"))


@train_app.command("dpo")
def dpo_cmd(
    model: str = typer.Option(..., help="HF-format model directory (usually the SFT output)."),
    data: str = typer.Option(..., help='JSONL: {"prompt": ..., "chosen": ..., "rejected": ...} per line.'),
    out: str = OUT,
    beta: float = typer.Option(0.1),
    epochs: int = typer.Option(3),
    max_steps: int = typer.Option(None, "--max-steps"),
    batch_size: int = typer.Option(8, "--batch-size"),
    lr: float = typer.Option(5e-4),
    seed: int = typer.Option(0),
    threads: int = typer.Option(None),
    resume: bool = RESUME,
    lora_rank: int = LORA_RANK, lora_targets: str = LORA_TARGETS, lora_alpha: float = LORA_ALPHA, qlora: bool = QLORA,
) -> None:
    """Direct Preference Optimization against a frozen reference copy of --model."""
    from kvserve.train.dpo import DPOConfig, dpo

    params = locals()
    _run_stage(threads, lambda: dpo(_config(DPOConfig, params)), ("out", "steps", "reward_accuracy", "reward_margin"))


@train_app.command("merge")
def merge_cmd(
    model: str = typer.Option(..., help="The adapter's base: HF-format directory or a model name / GGUF."),
    adapter: str = typer.Option(..., help="LoRA adapter directory (PEFT layout)."),
    out: str = typer.Option(..., "--out", help="Output directory (HF format, fp32)."),
) -> None:
    """Fold a LoRA adapter into its base: W += scale * B A; the result serves without the adapter."""
    from kvserve.train.lora import merge

    with user_errors():
        path = merge(model, adapter, out)
    typer.echo(f"merged {adapter} into {model}: {path}")


@train_app.command("reward")
def reward_cmd(
    model: str = typer.Option(..., help="HF-format model directory: the backbone (usually the SFT output)."),
    out: str = OUT,
    data: str = typer.Option(None, help='JSONL: {"prompt": ..., "chosen": ..., "rejected": ...} per line.'),
    synthetic: str = typer.Option(None, help="No --data: write and use a checkable task: repeat | arithmetic."),
    epochs: int = typer.Option(3),
    max_steps: int = typer.Option(None, "--max-steps"),
    batch_size: int = typer.Option(16, "--batch-size"),
    lr: float = typer.Option(1e-3),
    heldout_every: int = typer.Option(10, "--heldout-every", help="Hold out every N-th pair."),
    eval_every: int = typer.Option(25, "--eval-every"),
    seed: int = typer.Option(0),
    threads: int = typer.Option(None),
    resume: bool = RESUME,
) -> None:
    """Reward model: a scalar head on the transformer, Bradley-Terry loss on chosen/rejected pairs."""
    from kvserve.errors import InvalidRequest
    from kvserve.train.reward import RewardConfig, reward, synthetic_preferences

    params = locals()

    def stage() -> dict:
        if (data is None) == (synthetic is None):
            raise InvalidRequest("give --data FILE or --synthetic repeat|arithmetic", param="data")
        path = data
        if synthetic:
            Path(out).mkdir(parents=True, exist_ok=True)
            path = str(synthetic_preferences(Path(out) / f"synthetic-{synthetic}.jsonl", task=synthetic, seed=seed,
                                             wrong_per_problem=12 if synthetic == "repeat" else 4))
        return reward(_config(RewardConfig, params, data=path))

    _run_stage(threads, stage, ("out", "steps", "heldout_accuracy", "train_accuracy", "heldout_pairs"))


@train_app.command("grpo")
def grpo_cmd(
    model: str = typer.Option(..., help="HF-format model directory (usually the SFT output)."),
    out: str = OUT,
    task: str = typer.Option("arithmetic", help="arithmetic | repeat | think (multi-step sums in <think></think>) "
                             "| think-mul (a*b+c*d in <think></think>)."),
    max_operand: int = typer.Option(9, "--max-operand"),
    group_size: int = typer.Option(8, "--group-size"),
    prompts_per_step: int = typer.Option(4, "--prompts-per-step"),
    max_steps: int = typer.Option(50, "--max-steps"),
    max_tokens: int = typer.Option(8, "--max-tokens"),
    temperature: float = typer.Option(1.0),
    kl_coef: float = typer.Option(0.0, "--kl-coef", help="KL penalty to the starting model (0 = off)."),
    no_std: bool = typer.Option(False, "--no-std", help="Advantage = reward - group mean, not divided by std."),
    reward_model: str = typer.Option(None, "--reward-model", help="Reward by this `kvserve train reward` "
                                     "model's score instead of the task's check (RLHF)."),
    heldout: bool = typer.Option(False, "--heldout", help="Train only on problems outside the eval set."),
    terms: int = typer.Option(3, help="Numbers per problem (task think)."),
    eval_prompts: int = typer.Option(32, "--eval-prompts"),
    eval_samples: int = typer.Option(16, "--eval-samples"),
    lr: float = typer.Option(2e-4),
    seed: int = typer.Option(0),
    threads: int = typer.Option(None),
    resume: bool = RESUME,
) -> None:
    """Group Relative Policy Optimization with a verifiable reward, sampling through kvserve's engine."""
    from kvserve.train.grpo import GRPOConfig, grpo

    shown = ("out", "eval_reward_before", "eval_reward_after", "eval_accuracy_before", "eval_accuracy_after",
             "eval_greedy_accuracy_before", "eval_greedy_accuracy_after", "eval_thinking_before", "eval_thinking_after")
    params = locals()
    _run_stage(threads, lambda: grpo(_config(GRPOConfig, params, scale_rewards=not no_std)), shown)


@eval_app.command("perplexity")
def perplexity_cmd(
    model: str = typer.Option(None, help="Model directory, .gguf file or built-in name."),
    text: str = typer.Option(None, help="Text file; default: the held-out part of the bundled corpus."),
    seq_len: int = typer.Option(512, "--seq-len"),
    max_windows: int = typer.Option(None, "--max-windows", help="Evaluate at most this many windows."),
    threads: int = typer.Option(None),
    weight_format: Annotated[list[str] | None, typer.Option(
        "--weight-format", help="fp32 (default), bf16, fp16, auto (GGUF packed where a kernel exists), gguf; "
        "repeatable: one table row each.")] = None,
    peer: Annotated[list[str] | None, typer.Option(
        "--peer", help="Also score the same token windows with: llama-cpp.")] = None,
    paged_chunk: int = typer.Option(None, "--paged-chunk", min=1, help="Score through the serving path: the "
                                    "paged KV cache, this many tokens per forward pass (1 = every token decoded)."),
    kv_cache_dtype: Annotated[list[str] | None, typer.Option(
        "--kv-cache-dtype", help="With --paged-chunk: fp16 (default), bf16, fp32, int8; repeatable.")] = None,
) -> None:
    """Perplexity and bits per byte of a model on a text (a table when several formats or peers)."""
    from kvserve.errors import InvalidRequest
    from kvserve.train.data import load_corpus, split_documents
    from kvserve.train.evaluate import llama_cpp_perplexity, perplexity, perplexity_table

    _threads(threads)
    weight_format, peer = weight_format or ["fp32"], peer or []
    rows = []
    with user_errors(os_error=lambda e: f"cannot read {text}: {e.strerror}"):
        if any(p != "llama-cpp" for p in peer):
            raise InvalidRequest(f"unknown peer in {peer}: the one peer is llama-cpp", param="peer")
        body = Path(text).read_text(errors="replace") if text else "\n\n".join(split_documents(load_corpus())[1])
        for fmt in weight_format:
            if not paged_chunk:
                rows.append((f"kvserve {fmt}", perplexity(model, body, seq_len=seq_len, max_windows=max_windows,
                                                          weight_format=fmt)))
                continue
            for kv in kv_cache_dtype or ["fp16"]:
                rows.append((f"kvserve {fmt}, {kv} KV cache, {paged_chunk}-token passes",
                             perplexity(model, body, seq_len=seq_len, max_windows=max_windows, weight_format=fmt,
                                        paged_chunk=paged_chunk, kv_cache_dtype=kv)))
        for _ in peer:
            rows.append(("llama.cpp", llama_cpp_perplexity(model, body, seq_len=seq_len, max_windows=max_windows,
                                                           threads=threads)))
    if len(rows) > 1:
        typer.echo(perplexity_table(rows))
        return
    r = rows[0][1]
    typer.echo(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.as_dict().items()}, indent=2))
