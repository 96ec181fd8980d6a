"""`kvserve bench throughput`: offline throughput of N requests with random lengths, kvserve vs peers.

The workload is fixed by a seed: N prompts of random token ids (the ordinary-token range) with
input lengths drawn uniformly from [input_min, input_max] and output lengths from
[output_min, output_max]. Every engine decodes greedily and produces exactly the drawn number
of output tokens (kvserve: ignore_eos + max_tokens; transformers: min_new_tokens ==
max_new_tokens), so all of them do the same work:

    kvserve       all N requests handed to the engine at once (continuous batching, chunked
                  prefill, paged KV cache), as `LLM.generate` does
    transformers  `model.generate` one request at a time on fp32 weights dequantized from the
                  same GGUF (what a plain Hugging Face script does)

Reported per engine: requests/s, total tokens/s ((prompt + output) / wall time) and output
tokens/s, the definitions of vLLM's `benchmark_throughput`.
"""

from __future__ import annotations

import gc
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import torch
import typer

from kvserve.bench.common import (
    console,
    progress,
    progress_events,
    save_bar_charts,
    transformers_peer,
    write_outputs,
)
from kvserve.errors import InvalidRequest, KVServeError

Emit = Callable[..., None]
PEERS = ("transformers",)


@dataclass
class ThroughputConfig:
    model: str | None = None              # kvserve model name or path (default: SmolLM2-135M-Instruct Q4_1)
    num_prompts: int = 64
    input_min: int = 32
    input_max: int = 512
    output_min: int = 16
    output_max: int = 128
    seed: int = 0
    threads: int = 2
    weight_format: str = "auto"
    kv_cache_memory: str = "1GiB"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    peers: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for lo, hi in (("input_min", "input_max"), ("output_min", "output_max")):
            if not 1 <= getattr(self, lo) <= getattr(self, hi):
                raise InvalidRequest(f"need 1 <= {lo} <= {hi}, got {getattr(self, lo)} and {getattr(self, hi)}",
                                     param=lo)
        for p in self.peers:
            if p not in PEERS:
                raise InvalidRequest(f"unknown peer {p!r}; choose from {', '.join(PEERS)}", param="peer")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class ThroughputResult:
    engine: str
    detail: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.elapsed_s

    def as_dict(self) -> dict:
        return {**self.__dict__, "requests_per_s": self.requests_per_s, "total_tps": self.total_tps,
                "output_tps": self.output_tps}


def make_workload(cfg: ThroughputConfig, vocab_size: int) -> Workload:
    rng = random.Random(cfg.seed)
    hi_id = min(vocab_size, 30000)
    prompts, outs = [], []
    for _ in range(cfg.num_prompts):
        n = rng.randint(cfg.input_min, cfg.input_max)
        prompts.append([rng.randrange(100, hi_id) for _ in range(n)])
        outs.append(rng.randint(cfg.output_min, cfg.output_max))
    return Workload(prompts, outs)


def run_kvserve(cfg: ThroughputConfig, emit: Emit) -> tuple[ThroughputResult, Workload]:
    from kvserve.engine.llm import LLM
    from kvserve.sampling_params import SamplingParams

    torch.set_num_threads(cfg.threads)
    emit("load", engine="kvserve")
    llm = LLM(cfg.model, weight_format=cfg.weight_format, kv_cache_memory=cfg.kv_cache_memory,
              max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens)
    eng = llm.engine
    wl = make_workload(cfg, eng.info.vocab_size)
    if max(len(p) for p in wl.prompts) + cfg.output_max > eng.max_model_len:
        raise InvalidRequest(f"input_max + output_max exceeds the context ({eng.max_model_len} tokens)",
                             param="input_max")
    # Warm-up outside the timed region: thread pools, allocator, first-call overheads.
    llm.generate([wl.prompts[0][:16]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    emit("start", engine="kvserve", total=len(wl.prompts))
    done = output_tokens = 0
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens)):
        eng.add_request(f"bench-{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                         skip_special_tokens=False))
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done += 1
                output_tokens += len(out.outputs[0].token_ids)
                emit("advance", n=1)
    elapsed = time.perf_counter() - t0
    if done != len(wl.prompts) or output_tokens != wl.output_tokens:
        raise RuntimeError(f"kvserve produced {output_tokens} output tokens, the workload asks {wl.output_tokens}")
    s = llm.stats()
    detail = (f"{eng.model_name} ({cfg.weight_format}), {cfg.threads} threads, max_num_seqs {cfg.max_num_seqs}, "
              f"{cfg.max_num_batched_tokens} tokens/step, {s['num_steps']} steps, "
              f"{s['num_preemptions']} preemptions")
    res = ThroughputResult("kvserve", detail, len(wl.prompts), wl.prompt_tokens, output_tokens, elapsed)
    emit("done", result=res)
    return res, wl


def run_transformers(cfg: ThroughputConfig, wl: Workload, emit: Emit) -> ThroughputResult:
    import transformers

    emit("load", engine="transformers")
    model, path = transformers_peer(cfg.model, cfg.threads)
    gen_kw = {"do_sample": False, "pad_token_id": model.config.eos_token_id if model.config.pad_token_id is None
              else model.config.pad_token_id}
    with torch.inference_mode():
        model.generate(torch.tensor([wl.prompts[0][:16]]), max_new_tokens=2, min_new_tokens=2, **gen_kw)
        emit("start", engine="transformers", total=len(wl.prompts))
        output_tokens = 0
        t0 = time.perf_counter()
        for p, n in zip(wl.prompts, wl.output_lens):
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 **gen_kw)
            output_tokens += out.shape[1] - len(p)
            emit("advance", n=1)
        elapsed = time.perf_counter() - t0
    if output_tokens != wl.output_tokens:
        raise RuntimeError(f"transformers produced {output_tokens} output tokens, the workload asks "
                           f"{wl.output_tokens}")
    detail = f"transformers {transformers.__version__}, fp32 from {path.name}, {cfg.threads} threads, batch 1"
    res = ThroughputResult("transformers", detail, len(wl.prompts), wl.prompt_tokens, output_tokens, elapsed)
    emit("done", result=res)
    del model
    gc.collect()
    return res


def run_throughput(cfg: ThroughputConfig, on_event: Emit | None = None) -> list[ThroughputResult]:
    """kvserve, then each peer on the same workload. on_event(kind, **info): ("load", engine=),
    ("start", engine=, total=), ("advance", n=), ("done", result=)."""
    emit = on_event or (lambda *a, **k: None)
    res, wl = run_kvserve(cfg, emit)
    results = [res]
    gc.collect()
    for peer in cfg.peers:
        results.append(run_transformers(cfg, wl, emit))
    return results


def markdown_table(results: list[ThroughputResult]) -> str:
    base = results[0]
    lines = [("| engine | requests | prompt tokens | output tokens | seconds | requests/s | total tok/s "
              "| output tok/s | output tok/s vs kvserve | detail |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        lines.append(f"| {r.engine} | {r.num_requests} | {r.prompt_tokens} | {r.output_tokens} | {r.elapsed_s:.1f} "
                     f"| {r.requests_per_s:.2f} | {r.total_tps:.1f} | {r.output_tps:.1f} "
                     f"| {r.output_tps / base.output_tps:.2f}x | {r.detail} |")
    return "\n".join(lines)


def save_chart(results: list[ThroughputResult], path: str | Path, title: str = "") -> None:
    save_bar_charts(path, [r.engine for r in results], ["#3b7dd8", "#5fa55a", "#d8793b", "#999999"][: len(results)], [
        ("requests/s", [r.requests_per_s for r in results], "%.2f"),
        ("total tokens/s", [r.total_tps for r in results], "%.0f"),
        ("output tokens/s", [r.output_tps for r in results], "%.0f"),
    ], width=11, title=title)


def throughput(
    model: str = typer.Option(None, help="Model name or path (default: SmolLM2-135M-Instruct Q4_1)."),
    num_prompts: int = typer.Option(64, "--num-prompts", "-n", min=1, help="Requests in the workload."),
    input_min: int = typer.Option(32, min=1, help="Shortest prompt (tokens)."),
    input_max: int = typer.Option(512, min=1, help="Longest prompt (tokens)."),
    output_min: int = typer.Option(16, min=1, help="Fewest output tokens."),
    output_max: int = typer.Option(128, min=1, help="Most output tokens."),
    seed: int = typer.Option(0, help="Seed of the workload (lengths and token ids)."),
    threads: int = typer.Option(2, min=1, help="CPU threads for every engine."),
    weight_format: str = typer.Option("auto", help="kvserve weight format: auto, gguf, fp32, bf16, fp16, q8_0."),
    kv_cache_memory: str = typer.Option("1GiB", help="kvserve KV cache budget."),
    max_num_seqs: int = typer.Option(64, min=1, help="kvserve: most sequences per step."),
    max_num_batched_tokens: int = typer.Option(512, min=1, help="kvserve: token budget per step."),
    peer: Annotated[list[str] | None, typer.Option(help="Also run: transformers (repeatable).")] = None,
    out_dir: Annotated[Path, typer.Option(help="Where the table (.md, .json) and chart (.png) go.")] = Path(
        "runs/bench"),
) -> None:
    """Offline throughput: N requests with random input/output lengths; requests/s, total and output tokens/s."""
    try:
        cfg = ThroughputConfig(model=model, num_prompts=num_prompts, input_min=input_min, input_max=input_max,
                               output_min=output_min, output_max=output_max, seed=seed, threads=threads,
                               weight_format=weight_format, kv_cache_memory=kv_cache_memory,
                               max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                               peers=list(peer or []))
        with progress() as prog:

            def on_done(kind: str, info: dict) -> None:
                if kind == "done":     # each engine's numbers as soon as it finishes
                    r = info["result"]
                    console.print(f"{r.engine}: {r.requests_per_s:.2f} req/s, {r.total_tps:.1f} total tok/s, "
                                  f"{r.output_tps:.1f} output tok/s ({r.elapsed_s:.1f} s)")

            results = run_throughput(cfg, progress_events(prog, on_done))
    except KVServeError as e:
        console.print(f"error: {e.message}")
        raise typer.Exit(1) from None
    head = (f"{num_prompts} requests, input {input_min}-{input_max} tokens, output {output_min}-{output_max} "
            f"tokens (seed {seed}), greedy, {threads} threads, load average {os.getloadavg()[0]:.1f}")
    table = markdown_table(results)
    print(head + "\n")
    print(table)
    write_outputs(out_dir, "throughput", table, [r.as_dict() for r in results])
    save_chart(results, out_dir / "throughput.png", head)
    console.print(f"wrote {out_dir}/throughput.md, throughput.json, throughput.png")
